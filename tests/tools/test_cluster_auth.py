"""The Compose cluster's token (AUTH, on by default) without a Docker engine: the per-run token
file, the Compose files and variables that hand it to the containers, what `up` says and
records, and `down` deleting it. The merged Compose files are rendered by the Compose command
(`compose config`, no engine needed) where one is installed. The cluster itself runs with the
token in tests/containers/test_compose_cluster.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from distlib_deploy.cluster import auth_token, commands, config, engine
from distlib.command import ToolError
from distlib_deploy.jobs import mpi_launch

ROOT = Path(__file__).resolve().parents[2]
MODES = ("tcp", "rank0", "file", "nfs", "mpi")
#: The services that run distlib in each mode: each must hold the token when AUTH is on.
HOLDERS = {"tcp": {"master", "worker"}, "rank0": {"worker"}, "file": {"worker"}, "nfs": {"worker"},
           "mpi": {"launcher", "worker"}}


def settings_of(tmp_path: Path, **env: str) -> config.Settings:
    return config.Settings.from_env(ROOT, {"CLUSTER_STATE_DIR": str(tmp_path / "state"), **env})


def find_compose():
    try:
        return engine.find_compose()
    except ToolError as exc:
        pytest.skip(f"no Compose command to render the files with: {exc}")


def rendered(cfg: config.Settings, run_id: str) -> str:
    """The merged Compose file `up` would use for ``run_id``, as the Compose command prints it."""
    compose = find_compose()
    done = subprocess.run([*compose.argv, "-p", config.project_name(run_id), *sum((["-f", f] for f in
                          cfg.compose_files()), []), "config"], env={**os.environ, **cfg.compose_variables(run_id)},
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return done.stdout


def env_of(service: dict) -> dict:
    env = service.get("environment") or {}
    return dict(e.split("=", 1) for e in env) if isinstance(env, list) else env


def mounts_token(service: dict, source: str) -> bool:
    """Whether ``service`` bind-mounts ``source`` read-only at the containers' token path (v1's
    short form or v2's long form)."""
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if (volume.get("source"), volume.get("target"), volume.get("read_only")) == \
                    (source, auth_token.CONTAINER_PATH, True):
                return True
        elif volume == f"{source}:{auth_token.CONTAINER_PATH}:ro":
            return True
    return False


# -- the token file -----------------------------------------------------------------------------


def test_each_run_gets_a_new_random_token_in_a_private_file(tmp_path):
    first = auth_token.make(tmp_path / "auth")
    text = first.path.read_text().strip()
    assert len(text) == 64 and int(text, 16) >= 0  # secrets.token_hex(32)
    assert (tmp_path / "auth").stat().st_mode & 0o777 == 0o700
    if os.getuid() in (0, auth_token.IMAGE_UID):
        assert first.mode == 0o600 and first.path.stat().st_mode & 0o777 == 0o600
        # the containers read it as the image's user
        assert first.path.stat().st_uid == auth_token.IMAGE_UID
    second = auth_token.make(tmp_path / "auth")
    assert second.path == first.path and second.path.read_text().strip() != text
    auth_token.remove(tmp_path / "auth")
    assert not (tmp_path / "auth").exists()


def test_a_host_user_who_cannot_give_the_file_away_keeps_it_in_the_private_directory(tmp_path, monkeypatch):
    """Neither root nor uid 1000: the file cannot belong to the image's user, so it is readable
    (644) inside the 700 directory, which no other user of the host can enter."""
    monkeypatch.setattr(auth_token.os, "getuid", lambda: 4321)
    monkeypatch.setattr(auth_token.os, "chown", lambda *a: pytest.fail("chown needs root"))
    token = auth_token.make(tmp_path / "auth")
    assert token.mode == 0o644 and token.path.stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "auth").stat().st_mode & 0o777 == 0o700


def test_an_unwritable_state_directory_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ToolError, match=r"cannot write the run's token file in .*AUTH=0 runs without a token"):
        auth_token.make(blocker / "auth")


# -- settings and Compose files -------------------------------------------------------------------


def test_auth_is_on_unless_turned_off(tmp_path):
    assert settings_of(tmp_path).auth is True
    for off in ("0", "no", "off", "false"):
        assert settings_of(tmp_path, AUTH=off).auth is False
    with pytest.raises(ToolError, match=r"AUTH='maybe' is not a yes/no flag") as info:
        settings_of(tmp_path, AUTH="maybe")
    assert info.value.status == 2


@pytest.mark.parametrize("mode", MODES)
def test_the_token_files_compose_gets_in_each_mode(tmp_path, mode):
    on = settings_of(tmp_path, MODE=mode)
    names = [Path(f).name for f in on.compose_files()]
    assert "auth.yml" in names
    assert ("auth-master.yml" in names) == (mode == "tcp")
    assert ("auth-launcher.yml" in names) == (mode == "mpi")
    path = on.compose_variables("r1")["AUTH_TOKEN_FILE"]
    assert path == str(tmp_path / "state" / "distlib-r1" / "auth" / "token")
    off = settings_of(tmp_path, MODE=mode, AUTH="0")
    assert not any(Path(f).name.startswith("auth") for f in off.compose_files())
    assert "AUTH_TOKEN_FILE" not in off.compose_variables("r1")


@pytest.mark.parametrize("mode, gpu", [(mode, "0") for mode in MODES] + [("tcp", "1"), ("rank0", "1")])
def test_every_service_that_runs_distlib_mounts_the_token_read_only_and_never_sees_its_value(tmp_path, mode, gpu):
    cfg = settings_of(tmp_path, MODE=mode, NODES="3", GPU=gpu)
    token = auth_token.make(cfg.auth_dir("r1"))
    secret = token.path.read_text().strip()
    text = rendered(cfg, "r1")
    assert secret not in text
    assert all(secret not in v for v in cfg.compose_variables("r1").values())
    services = yaml.safe_load(text)["services"]
    holders = {name for name, service in services.items() if mounts_token(service, str(token.path))}
    assert holders == HOLDERS[mode]
    for name in holders:
        env = env_of(services[name])
        assert env["DISTLIB_AUTH_TOKEN_FILE"] == auth_token.CONTAINER_PATH
        assert "DISTLIB_AUTH_TOKEN" not in env


@pytest.mark.parametrize("mode", ["tcp", "mpi"])
def test_auth_off_leaves_every_trace_of_the_token_out(tmp_path, mode):
    cfg = settings_of(tmp_path, MODE=mode, AUTH="0")
    text = rendered(cfg, "r1")
    assert "DISTLIB_AUTH_TOKEN" not in text and auth_token.CONTAINER_PATH not in text


def test_mpirun_passes_the_token_files_path_on_to_the_ranks():
    nodes = mpi_launch.plan(["10.0.0.2"], 1)
    cmd = mpi_launch.mpirun_command(nodes, Path("/h/hostfile"), ["-m", "distlib_deploy.jobs.train_dp"], "/workspace",
                                    "eth0", {"DISTLIB_RUN_ID": "r1",
                                             "DISTLIB_AUTH_TOKEN_FILE": auth_token.CONTAINER_PATH})
    text = " ".join(cmd)
    assert "-x DISTLIB_AUTH_TOKEN_FILE" in text
    assert auth_token.CONTAINER_PATH not in text  # -x NAME: the value comes from the launcher's environment


# -- up and down, with the engine and Compose played by stand-ins -----------------------------------


class FakeCompose:
    """Records what `compose up` was given and checks the token file exists by then."""

    def __init__(self):
        self.calls = []

    def __call__(self, compose, project, files, args, env, log_path=None, timeout=None):
        path = env.get("AUTH_TOKEN_FILE")
        self.calls.append(SimpleNamespace(project=project, files=list(files), args=list(args), env=dict(env),
                                          token=Path(path).read_text().strip() if path else None))
        if log_path:
            Path(log_path).write_text("compose: done\n")
        return subprocess.CompletedProcess(args, 0)


@pytest.fixture
def stand_ins(monkeypatch):
    fake = FakeCompose()
    monkeypatch.setattr(commands.engine, "run_compose", fake)
    # the two workers every test here starts (NODES=2)
    monkeypatch.setattr(commands.engine, "project_containers", lambda client, project, service=None: [object()] * 2)
    return fake


@pytest.mark.parametrize("mode", ["tcp", "mpi"])
def test_up_makes_the_token_before_compose_and_says_so_without_it(tmp_path, stand_ins, capsys, monkeypatch, mode):
    monkeypatch.setattr(commands.ssh_keys, "make", lambda directory, *a, **k: SimpleNamespace(directory=directory))
    cfg = settings_of(tmp_path, MODE=mode, NODES="2", RUN_ID="r1")
    cfg.state_dir.mkdir(parents=True)
    run, _ = commands._start(cfg, None, engine.Compose(("docker-compose",), "1.29.2"))
    (call,) = stand_ins.calls
    token = call.token
    assert token and len(token) == 64
    token_file = tmp_path / "state" / "distlib-r1" / "auth" / "token"
    assert call.env["AUTH_TOKEN_FILE"] == str(token_file) and token_file.read_text().strip() == token
    assert not any(token in v for k, v in call.env.items() if k not in os.environ or os.environ[k] != v)
    assert any(f.endswith("auth.yml") for f in call.files)
    err = capsys.readouterr().err
    assert "auth on: made this run's token in " + str(token_file) in err
    assert token not in err
    record = (tmp_path / "state" / "current.json").read_text()
    assert token not in record and json.loads(record)["auth"] is True
    assert run.auth is True


def test_up_with_auth_off_makes_no_token_and_says_what_that_admits(tmp_path, stand_ins, capsys):
    cfg = settings_of(tmp_path, MODE="tcp", NODES="2", RUN_ID="r2", AUTH="0")
    cfg.state_dir.mkdir(parents=True)
    commands._start(cfg, None, engine.Compose(("docker-compose",), "1.29.2"))
    (call,) = stand_ins.calls
    assert call.token is None and "AUTH_TOKEN_FILE" not in call.env
    assert not any("auth" in Path(f).name for f in call.files)
    assert not (tmp_path / "state" / "distlib-r2" / "auth").exists()
    assert "auth OFF (AUTH=0)" in capsys.readouterr().err
    assert json.loads((tmp_path / "state" / "current.json").read_text())["auth"] is False


def test_down_deletes_the_runs_token(tmp_path, stand_ins, monkeypatch):
    cfg = settings_of(tmp_path, MODE="rank0", NODES="2", RUN_ID="r3")
    cfg.state_dir.mkdir(parents=True)
    commands._start(cfg, None, engine.Compose(("docker-compose",), "1.29.2"))
    assert (tmp_path / "state" / "distlib-r3" / "auth" / "token").is_file()
    monkeypatch.setattr(commands.engine, "connect", lambda: None)
    monkeypatch.setattr(commands.engine, "remove_by_label", lambda client, label: [])
    monkeypatch.setattr(commands.engine, "labelled", lambda client, label: {"containers": []})
    assert commands.down(cfg) == 0
    assert not (tmp_path / "state" / "distlib-r3" / "auth").exists()


def test_master_sync_reaches_the_master_s_command_and_a_bad_value_is_refused(tmp_path: Path) -> None:
    """MASTER_SYNC=none gives the master `--sync none`; unset, `--sync turn`; anything else is
    refused before anything starts, naming the two values."""
    with pytest.raises(ToolError) as info:
        settings_of(tmp_path, MASTER_SYNC="always")
    assert info.value.status == 2 and "MASTER_SYNC=always: turn" in str(info.value) and "or none" in str(info.value)
    for given, expected in (("none", "none"), ("", "turn")):
        cfg = settings_of(tmp_path, MODE="tcp", MASTER_SYNC=given)
        master = yaml.safe_load(rendered(cfg, "sync-check"))["services"]["master"]
        command = master["command"]
        assert command[command.index("--sync") + 1] == expected, (given, command)
