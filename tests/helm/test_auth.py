"""The chart's shared token (auth.enabled, on by default), rendered with Helm's engine: the Secret
it makes (or auth.existingSecret), the read-only mount and DISTLIB_AUTH_TOKEN_FILE in the master,
every worker and the helm test pod, the token in no environment, and auth.enabled=false
rendering none of it. Running the pods with the token: test_rendered_run.py."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from ._chart import CHART_DIR, RELEASE, Rendered, render, scenario_values

PATH = "/run/secrets/distlib/token"


def containers(r: Rendered) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """{"master" | "worker" | "test" | "init:<name>": (container, its pod spec)}."""
    out = {}
    for d in r.docs:
        if d["kind"] in ("Job", "Deployment"):
            spec = d["spec"]["template"]["spec"]
            component = d["metadata"]["labels"]["app.kubernetes.io/component"]
        elif d["kind"] == "Pod":
            spec, component = d["spec"], "test"
        else:
            continue
        for c in spec["containers"]:
            out[component] = (c, spec)
        for c in spec.get("initContainers", []):
            out[f"init:{c['name']}"] = (c, spec)
    return out


def token_wiring(c: dict[str, Any], spec: dict[str, Any]) -> tuple[str, str] | None:
    """(Secret name, key) the container reads its token from at PATH, or None; asserts the
    mount is read-only and DISTLIB_AUTH_TOKEN_FILE names the file."""
    env = {e["name"]: e for e in c.get("env", [])}
    mounts = [m for m in c.get("volumeMounts", []) if PATH.startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts:
        assert "DISTLIB_AUTH_TOKEN_FILE" not in env, c["name"]
        return None
    (mount,) = mounts
    assert mount["readOnly"] is True
    assert env["DISTLIB_AUTH_TOKEN_FILE"] == {"name": "DISTLIB_AUTH_TOKEN_FILE", "value": PATH}
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    (item,) = secret["items"]
    assert PATH == mount["mountPath"].rstrip("/") + "/" + item["path"]
    # group-readable only: the kubelet gives it podSecurityContext.fsGroup, the containers' group
    assert secret["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"] == 1000
    return secret["secretName"], item["key"]


def the_secret(r: Rendered) -> dict[str, Any]:
    (secret,) = r.of_kind("Secret")
    return secret


@pytest.mark.parametrize("scenario", ["tcp", "rank0", "file-claim", "gpu"])
def test_by_default_every_container_that_runs_distlib_reads_the_charts_token(chart: Any, scenario: str) -> None:
    r = render(chart, scenario_values(scenario))
    secret = the_secret(r)
    name = secret["metadata"]["name"]
    assert name == f"{RELEASE}-distlib-auth" and secret["type"] == "Opaque"
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 64 and token.isalnum()
    wired = {k: token_wiring(c, spec) for k, (c, spec) in containers(r).items()}
    expected = {"worker": (name, "token")}
    if scenario in ("tcp", "gpu"):
        expected.update(master=(name, "token"), test=(name, "token"))
    if scenario == "file-claim":
        expected["init:store-dir"] = None  # mkdir of the run's directory: no store, no token
    assert wired == expected
    # the token itself is in no container's environment or command line
    for c, _ in containers(r).values():
        assert token not in str(c)


def test_the_probes_and_the_helm_test_ping_read_the_token_the_master_requires(chart: Any) -> None:
    """`distlib store-server --ping` authenticates with DISTLIB_AUTH_TOKEN_FILE: the probes run
    in the master's container (which has it) and the test pod has it too."""
    r = render(chart)
    master, _ = containers(r)["master"]
    env = {e["name"]: e.get("value") for e in master["env"]}
    assert env["DISTLIB_AUTH_TOKEN_FILE"] == PATH
    assert master["readinessProbe"]["exec"]["command"][:3] == ["distlib", "store-server", "--ping"]
    ping, _ = containers(r)["test"]
    assert ping["command"][:3] == ["distlib", "store-server", "--ping"]
    assert {e["name"]: e.get("value") for e in ping["env"]}["DISTLIB_AUTH_TOKEN_FILE"] == PATH


def test_each_render_without_a_cluster_makes_a_new_random_token(chart: Any) -> None:
    """Offline (helm template), lookup finds no Secret: a fresh token each time. In a cluster the
    template reuses the data of the existing Secret (lookup), so `helm upgrade` keeps it."""
    a, b = (base64.b64decode(the_secret(render(chart))["data"]["token"]) for _ in range(2))
    assert a != b and len(a) == len(b) == 64
    template = (CHART_DIR / "templates" / "auth-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template


def test_an_existing_secret_is_mounted_and_none_is_made(chart: Any) -> None:
    r = render(chart, {"auth": {"existingSecret": "team-token", "existingSecretKey": "distlib"}})
    assert r.of_kind("Secret") == []
    wired = {k: token_wiring(c, spec) for k, (c, spec) in containers(r).items()}
    assert wired == {"master": ("team-token", "distlib"), "worker": ("team-token", "distlib"),
                     "test": ("team-token", "distlib")}
    r = render(chart, {"auth": {"existingSecret": "team-token"}})
    assert token_wiring(*containers(r)["worker"]) == ("team-token", "token")  # the default key


@pytest.mark.parametrize("scenario", ["tcp", "rank0", "file-nfs"])
def test_auth_disabled_renders_no_secret_no_mount_no_variable(chart: Any, scenario: str) -> None:
    values = scenario_values(scenario)
    values["auth"] = {"enabled": False}
    r = render(chart, values)
    assert r.of_kind("Secret") == []
    for c, spec in containers(r).values():
        assert token_wiring(c, spec) is None
        assert not any(v["name"] == "auth-token" for v in spec.get("volumes", []))
    assert "auth: OFF (auth.enabled=false)" in r.notes


def test_notes_say_where_the_token_is(chart: Any) -> None:
    notes = render(chart).notes
    assert f"auth: on, every connection proves the token in Secret {RELEASE}-distlib-auth (key token)" in notes
    assert "--set auth.enabled=false admits them" in notes


def test_a_shared_master_needs_its_own_token(helm: Any, chart: Any) -> None:
    """master.externalEndpoint: a token made here cannot be the shared server's, so the chart
    asks for auth.existingSecret (or auth.enabled=false) instead of rendering a job that fails."""
    with pytest.raises(helm.HelmRenderError, match="set auth.existingSecret .* or set auth.enabled=false"):
        render(chart, {"master": {"externalEndpoint": "store.infra:29500"}})
    r = render(chart, {"master": {"externalEndpoint": "store.infra:29500"}, "auth": {"existingSecret": "infra"}})
    assert token_wiring(*containers(r)["worker"]) == ("infra", "token")


@pytest.mark.parametrize("values, words", [
    ({"auth": {"enabled": "yes"}}, "enabled"),
    ({"auth": {"existingSecret": "Not_A_Name"}}, "existingSecret"),
    ({"auth": {"existingSecretKey": "a/b"}}, "existingSecretKey"),
    ({"auth": {"token": "x" * 32}}, "token"),
])
def test_the_schema_refuses_bad_auth_values(helm: Any, chart: Any, values: dict, words: str) -> None:
    with pytest.raises(helm.HelmError, match=words):
        render(chart, values)

