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
