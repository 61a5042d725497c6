"""The sequence header that numbers a write a retry must not apply twice (exactly-once writes:
docs/wire-protocol.md, docs/stores.md): a SET of codec.SEQUENCE_KEY whose value is the
client's 16-byte session and a u64 sequence number, sent in the same send as the write.

Its bytes are built here, their fixed start once: the client pays this on every numbered
write, and the engine recognises a header by that start.
"""

from __future__ import annotations

from .codec import SEQUENCE_KEY, U64, Op

#: What every sequence header starts with (its opcode, key and value length), and its length.
SEQUENCE_PREFIX = bytes([Op.SET]) + U64.pack(len(SEQUENCE_KEY)) + SEQUENCE_KEY + U64.pack(24)
SEQUENCE_HEADER_BYTES = len(SEQUENCE_PREFIX) + 24


def sequence_header(session: bytes, seq: int) -> bytes:
    """The SET that numbers the write sent right after it (``SEQUENCE_KEY``): the SET's bytes,
    its fixed start precomputed (a numbered write pays this on every call)."""
    return SEQUENCE_PREFIX + session + U64.pack(seq)
