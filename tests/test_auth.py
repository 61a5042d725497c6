"""distlib/auth.py: the token challenge-response both ways, as pure messages and on real sockets."""

import socket

import pytest

from distlib import auth
from distlib.deadline import Deadline

TOKEN = b"k" * 16
OTHER = b"j" * 16


def exchange(listener_token, peer_token):
    msg, listener_nonce = auth.challenge()
    response, peer_nonce, seen_nonce = auth.respond(peer_token, msg)
    assert seen_nonce == listener_nonce
    verdict = auth.verify_response(listener_token, listener_nonce, response)
    return verdict, peer_nonce, listener_nonce


def test_the_worked_example_of_the_docstring():
    msg, _ = auth.challenge(b"\x01" * 32)
    assert msg == b"DISTLIB-AUTH/1\n" + b"\x01" * 32
    response, _, _ = auth.respond(TOKEN, msg, b"\x02" * 32)
    assert response[:32] == b"\x02" * 32 and response[32:34] == bytes.fromhex("3fd2")
    verdict = auth.verify_response(TOKEN, b"\x01" * 32, response)
    assert verdict[0] == auth.ACCEPTED and verdict[1:3] == bytes.fromhex("6a7d")


def test_the_same_token_is_accepted_both_ways():
    verdict, peer_nonce, listener_nonce = exchange(TOKEN, TOKEN)
    assert verdict is not None
    assert auth.verify_verdict(TOKEN, peer_nonce, listener_nonce, verdict)


def test_a_peer_with_another_token_is_refused():
    verdict, _, _ = exchange(TOKEN, OTHER)
    assert verdict is None


def test_a_listener_with_another_token_cannot_prove_itself():
    """A listener that accepts anyone (an impostor) still cannot produce the listener's MAC."""
    msg, listener_nonce = auth.challenge()
    response, peer_nonce, _ = auth.respond(TOKEN, msg)
    forged = auth.verify_response(OTHER, listener_nonce, response) or \
        bytes([auth.ACCEPTED]) + response[32:]  # replaying the peer's own MAC back
    assert not auth.verify_verdict(TOKEN, peer_nonce, listener_nonce, forged)
    impostor = bytes([auth.ACCEPTED]) + auth._mac(OTHER, auth._LISTENER_LABEL, peer_nonce, listener_nonce)
    assert not auth.verify_verdict(TOKEN, peer_nonce, listener_nonce, impostor)


def test_a_response_to_another_challenge_is_refused():
    """Nonces bind the response to this connection: a recorded response does not replay."""
    old_msg, old_nonce = auth.challenge()
    recorded, _, _ = auth.respond(TOKEN, old_msg)
    _, new_nonce = auth.challenge()
    assert auth.verify_response(TOKEN, old_nonce, recorded) is not None
    assert auth.verify_response(TOKEN, new_nonce, recorded) is None


@pytest.mark.parametrize("response", [b"", b"x" * 63, b"x" * 65])
def test_a_response_of_the_wrong_length_is_refused(response):
    assert auth.verify_response(TOKEN, b"\x01" * 32, response) is None


def test_a_challenge_is_recognised_from_its_first_bytes():
    assert auth.is_challenge_start(b"D")
    assert auth.is_challenge_start(b"DISTLIB-AUTH/1\nxyz")
    assert not auth.is_challenge_start(b"\x00\x00\x00\x01")
    assert not auth.is_challenge_start(b"")


def _pair():
    a, b = socket.socketpair()
    return a, b


def test_a_silent_listener_fails_the_peer_at_its_deadline():
    listener, peer = _pair()
    with pytest.raises(auth.AuthError, match=r"listener 127.0.0.1:2 sent no authentication challenge within"):
        auth.connect_blocking(peer, TOKEN, Deadline(0.3), "listener 127.0.0.1:2")
    listener.close()


def test_a_listener_that_does_not_speak_auth_is_named():
    listener, peer = _pair()
    listener.sendall(b"\x00" * auth.CHALLENGE_BYTES)
    with pytest.raises(auth.AuthError, match="did not open with a distlib authentication challenge"):
        auth.connect_blocking(peer, TOKEN, Deadline(2), "listener 127.0.0.1:2")


def test_the_token_comes_from_the_variable_or_the_file(tmp_path):
    f = tmp_path / "token"
    f.write_text("s" * 40 + "\n")
    assert auth.configured_token({"DISTLIB_AUTH_TOKEN": "t" * 20}) == b"t" * 20
    assert auth.configured_token({"DISTLIB_AUTH_TOKEN_FILE": str(f)}) == b"s" * 40
    assert auth.configured_token({}) is None
    assert auth.token_from_file(str(f)) == b"s" * 40


def test_token_mistakes_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="both DISTLIB_AUTH_TOKEN and DISTLIB_AUTH_TOKEN_FILE are set"):
        auth.configured_token({"DISTLIB_AUTH_TOKEN": "t" * 20, "DISTLIB_AUTH_TOKEN_FILE": "/x"})
    with pytest.raises(ValueError, match=r"DISTLIB_AUTH_TOKEN holds a token of 5 characters; use at least 16"):
        auth.configured_token({"DISTLIB_AUTH_TOKEN": "short"})
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=rf"DISTLIB_AUTH_TOKEN_FILE={missing}: cannot read the token file: No such file"):
        auth.configured_token({"DISTLIB_AUTH_TOKEN_FILE": str(missing)})
    with pytest.raises(ValueError, match="--auth-token-file=.*: cannot read the token file"):
        auth.token_from_file(str(missing))


# -- warnings where a deployment is open (distlib/exposure.py, issue 28) ---------------------------

import logging  # noqa: E402
import os  # noqa: E402
import types  # noqa: E402

from distlib import exposure  # noqa: E402

EXPOSURE_LOG = "distlib.exposure"


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """Each test sees the process's first warnings again; returns the warnings logged."""
    monkeypatch.setattr(exposure, "_warned", set())
    caplog.set_level(logging.WARNING, EXPOSURE_LOG)
    return lambda: [r.getMessage() for r in caplog.records if r.name == EXPOSURE_LOG]


def _stat(uid: int, mode: int):
    return types.SimpleNamespace(st_uid=uid, st_mode=0o100000 | mode)


@pytest.mark.parametrize("uid, mode, problem", [
    (1000, 0o600, None),
    (1000, 0o400, None),
    (1000, 0o640, "it is readable by its group (mode 0640): chmod 600 it"),
    (1000, 0o644, "it is readable by others (mode 0644): chmod 600 it"),
    (1000, 0o666, "it is readable by others (mode 0666): chmod 600 it"),
    (1000, 0o620, "it is writable by its group (mode 0620): chmod 600 it"),
    (0, 0o440, None),  # a Kubernetes Secret: root's, readable by the pod's fsGroup
    (0, 0o444, "it is owned by root and readable or writable by others (mode 0444): make it 0440 or 0400"),
    (0, 0o460, "it is owned by root and writable by its group (mode 0460): make it 0440 or 0400"),
    (1001, 0o600, "it is owned by uid 1001"),
])
def test_the_token_file_rule(uid, mode, problem):
    found = exposure.token_file_problem(_stat(uid, mode), euid=1000)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem), found


def test_a_token_file_others_can_read_is_a_warning_once_and_refused_when_strict(tmp_path, fresh_warnings):
    f = tmp_path / "token"
    f.write_text("s" * 40)
    f.chmod(0o644)
    env = {"DISTLIB_AUTH_TOKEN_FILE": str(f)}
    assert auth.configured_token(env) == b"s" * 40
    assert auth.configured_token(env) == b"s" * 40
    assert fresh_warnings() == [
        f"DISTLIB_AUTH_TOKEN_FILE={f}: it is readable by others (mode 0644): chmod 600 it; whoever can read the "
        f"token can join the job, whoever can change it can lock the job out (set DISTLIB_AUTH_TOKEN_FILE_STRICT=1 "
        f"to refuse such files)"]
    with pytest.raises(ValueError, match=rf"DISTLIB_AUTH_TOKEN_FILE={f}: refused the token file: it is readable by "
                                         rf"others \(mode 0644\): chmod 600 it \(DISTLIB_AUTH_TOKEN_FILE_STRICT=1"):
        auth.configured_token(dict(env, DISTLIB_AUTH_TOKEN_FILE_STRICT="1"))
    f.chmod(0o600)
    assert auth.configured_token(dict(env, DISTLIB_AUTH_TOKEN_FILE_STRICT="1")) == b"s" * 40
    assert len(fresh_warnings()) == 1


def test_a_token_file_of_another_user_is_named(tmp_path, fresh_warnings):
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    f = tmp_path / "token"
    f.write_text("s" * 40)
    f.chmod(0o600)
    os.chown(f, 4242, 4242)
    with pytest.raises(ValueError, match=r"it is owned by uid 4242.*not by this process's user \(uid 0"):
        auth.configured_token({"DISTLIB_AUTH_TOKEN_FILE": str(f), "DISTLIB_AUTH_TOKEN_FILE_STRICT": "yes"})
    assert auth.token_from_file(str(f)) == b"s" * 40  # (warned: --auth-token-file is not strict without the variable)
    assert fresh_warnings()[0].startswith(f"--auth-token-file={f}: it is owned by uid 4242")


def _listener(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_a_listener_on_every_interface_without_a_token_is_a_warning_once(fresh_warnings):
    with _listener("0.0.0.0") as a, _listener("0.0.0.0") as b, _listener("127.0.0.1") as local:
        assert exposure.warn_open_listener("the store", a, None)
        assert not exposure.warn_open_listener("the store", b, None)  # once per process
        assert not exposure.warn_open_listener("the store", local, None)  # loopback: this host only
        assert not exposure.warn_open_listener("the gloo mesh", a, b"t" * 16)  # a token: fine
        port = a.getsockname()[1]
    assert fresh_warnings() == [
        f"the store listens on port {port} of every interface without a token: anyone who reaches port {port} of "
        f"every interface can join and send objects that are unpickled: set DISTLIB_AUTH_TOKEN_FILE (a file holding "
        f"`openssl rand -hex 32`, readable by this user only) in every process of the job (docs/security.md)"]


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True),
                                            ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.5", False), ("fe80::1%eth0", False)])
def test_what_counts_as_loopback(host, loopback):
    assert exposure.is_loopback(host) is loopback


def test_the_launchers_warning(fresh_warnings):
    assert not exposure.warn_open_job("127.0.0.1", 29500, False, multi_node=False)
    assert not exposure.warn_open_job("10.0.0.5", 29500, True, multi_node=True)
    assert exposure.warn_open_job("10.0.0.5", 29500, False, multi_node=True)
    assert fresh_warnings() == [
        "this job's store (10.0.0.5:29500) and its ranks' listeners run without a token: anyone who reaches them "
        "can join and send objects that are unpickled: " + exposure.TOKEN_ADVICE]


def test_init_process_group_warns_for_its_store_and_its_mesh(fresh_warnings, monkeypatch):
    """A one-rank gloo group whose store and mesh listen on every interface, without a token:
    one warning for each (rank 0's store server, the mesh's listener)."""
    import distlib.distributed as dist
    from distlib.store.tcp import TCPStore

    monkeypatch.setenv("DISTLIB_MESH_BIND_ALL", "1")
    monkeypatch.delenv("DISTLIB_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("DISTLIB_AUTH_TOKEN_FILE", raising=False)
    store = TCPStore("0.0.0.0", 0, 1, True, wait_for_workers=False)
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.destroy_process_group()
    finally:
        store.close()
    warnings = fresh_warnings()
    assert any(w.startswith("the store listens on port ") for w in warnings), warnings
    assert any(w.startswith("this rank's gloo mesh listens on port ") for w in warnings), warnings
