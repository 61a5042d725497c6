"""An observer of the store server's requests: who sent it (the peer's address), what (the
operation) and on which keys.

For the testing harness (distlib.testing's master service), whose faults fire when a rank sets
or waits for a key. It costs nothing when absent: the engine's table of handlers is wrapped
only when an observer is given. The server turns its batch path (batch.py) off while observed,
so that every request goes through the table. The observer is called after the request ran, in
the server's loop: it must be quick and must not raise.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

from . import codec
from .codec import Limits, Op

#: ``observer(peer, op, keys)``: ``peer`` "address:port", ``op`` the operation's name in lower
#: case (set, get, add, wait, compare_set, check, multi_get, ...), ``keys`` the keys it names.
Observer = Callable[[str, str, Tuple[bytes, ...]], None]

_SET = int(Op.SET)
_NAMES = {int(op): op.name.lower() for op in Op}


def keys_of(fields: Any, layout: codec.Layout) -> Tuple[bytes, ...]:
    """The keys among a decoded request's fields (codec.decode), by its layout."""
    if layout is codec.PAIRS:
        return tuple(bytes(k) for k, _ in fields[0])
    if "keys" in layout.fields:
        return tuple(bytes(k) for k in fields[layout.fields.index("keys")])
    if "key" in layout.fields:
        return (bytes(fields[layout.fields.index("key")]),)
    return ()


def observed_table(table: List[Callable], observer: Observer, limits: Limits) -> List[Callable]:
    """``table`` (one handler per opcode byte, handlers.py) with each handler followed by a call
    to ``observer`` for the request it ran."""

    def wrap(run: Callable) -> Callable:
        def observed(conn: Any, buf: Any, pos: int, end: int) -> int:
            r = run(conn, buf, pos, end)
            if r > 0:
                op, fields, after = codec.decode(buf, pos, r, limits)
                if op == _SET and fields[0] == codec.SEQUENCE_KEY:  # heard as the write it numbers
                    op, fields, _ = codec.decode(buf, after, r, limits)
                observer(str(conn.peer), _NAMES.get(op, hex(op)), keys_of(fields, codec.REQUESTS[op]))
            return r
        return observed

    return [wrap(run) for run in table]
