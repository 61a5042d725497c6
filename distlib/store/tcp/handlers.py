"""What each request does: decode its fields (codec.py), run it on the state (state.py),
queue its reply on the connection.

One function per opcode, looked up in a 256-entry table by the request's first byte (an
unknown opcode gets ``_op_unknown``). Each takes ``(conn, buf, pos, end)`` with the request
starting at ``buf[pos]`` and returns the offset after it, or ``-need`` when it has not fully
arrived (then nothing has run, and the server calls again once ``need`` bytes are there).
A request is decoded straight from the received bytes, so a large value costs one pass.

Replies are appended to ``conn.out``; the server sends them at the end of its loop turn, with
sendmsg, part by part. GET and MULTI_GET copy a value up to ``COPY_MAX`` bytes behind its
length field (one part, one small allocation); a larger one is appended as a ``memoryview`` of
the stored object, so such a reply never copies a large value (a client that asks for an 8 MiB
value a thousand times costs a thousand references, not 8 GiB), and sets ``conn.refs`` so that
the server sends with sendmsg instead of joining. The server's memory budget counts every
other part, and not these: they are the store's memory, not the client's.
COMPARE_SET and QUEUE_POP answer values that need not stay stored: they are copied.
Requests the protocol cannot answer raise: ProtocolError (malformed), StateError (refused
by the state) or CloseConnection; the server then closes that connection, with the reason in
its log (the protocol has no error reply, and torch's servers do the same).

Server-side rules beyond the state's (docs/wire-protocol.md): GET or MULTI_GET of a missing
key answers an empty value and keeps the connection (as libuv; legacy closes it); a CHECK of
``ORDERED_WAIT_PROBE_KEY`` alone answers READY without storing anything (the ordered-wait
capability, codec.py); a GET of ``INCARNATION_KEY``, a key never stored, answers the
server's incarnation (incarnation.py); an ADD on the worker counter ``init/`` is reported to
``on_worker`` (the in-process master counts its workers with it).
"""

from __future__ import annotations

from typing import Callable, List

from .codec import (
    I64,
    NOT_READY,
    ORDERED_WAIT_PROBE_KEY,
    READY,
    SEQUENCE_KEY,
    SEQUENCED_OPS,
    STOP_WAITING,
    U64,
    WAIT_CANCELED,
    WORKER_COUNTER_KEY,
    Limits,
    decode,
    Op,
    ProtocolError,
    read_key,
    read_key_2blobs,
    read_key_i64,
    read_key_value,
    read_keys,
    read_pairs,
    read_u32,
)
from .incarnation import INCARNATION_KEY
from .state import KeyValueState

_STOP = bytes([STOP_WAITING])
_CANCELED = bytes([WAIT_CANCELED])
_READY = bytes([READY])
_NOT_READY = bytes([NOT_READY])
_EMPTY_BLOB = U64.pack(0)
_ZERO_I64 = I64.pack(0)
_pack_u64 = U64.pack
_pack_i64 = I64.pack
_unpack_u64 = U64.unpack_from
_BARRIER = int(Op.BARRIER)
_UNANSWERED = frozenset({Op.APPEND, Op.MULTI_SET, Op.QUEUE_PUSH})

#: Values up to this size are copied behind their length in one reply part; larger ones are
#: sent from the stored object (see the module docstring).
COPY_MAX = 16 * 1024


class CloseConnection(Exception):
    """Close this client's connection, with this reason in the log."""


class Handlers:
    """The parse-and-run functions of one server, bound to its state and limits."""

    def __init__(self, state: KeyValueState, limits: Limits, on_worker: Callable[[object, int], None],
                 incarnation: bytes = b""):
        self.state = state
        #: The answer to a GET of INCARNATION_KEY (incarnation.py).
        self._incarnation = U64.pack(len(incarnation)) + incarnation
        self.limits = limits
        self.on_worker = on_worker
        self._get = state.data.get  # GET and MULTI_GET read the data directly (state.py allows it)

    def table(self) -> List[Callable]:
        """The 256-entry table: opcode byte -> parse-and-run function."""
        ops: List[Callable] = [self._op_unknown] * 256
        for op, fn in (
            (Op.VALIDATE, self._op_validate),
            (Op.SET, self._op_set),
            (Op.COMPARE_SET, self._op_compare_set),
            (Op.GET, self._op_get),
            (Op.ADD, self._op_add),
            (Op.CHECK, self._op_check),
            (Op.WAIT, self._op_wait),
            (Op.GETNUMKEYS, self._op_num_keys),
            (Op.DELETE_KEY, self._op_delete_key),
            (Op.APPEND, self._op_append),
            (Op.MULTI_GET, self._op_multi_get),
            (Op.MULTI_SET, self._op_multi_set),
            (Op.CANCEL_WAIT, self._op_cancel_wait),
            (Op.PING, self._op_ping),
            (Op.QUEUE_PUSH, self._op_queue_push),
            (Op.QUEUE_POP, self._op_queue_pop),
            (Op.QUEUE_LEN, self._op_queue_len),
            (Op.LIST_KEYS, self._op_list_keys),
            (Op.BARRIER, self._op_barrier),
        ):
            ops[op] = fn
        self._ops = ops
        return ops

    def cancel_wait(self, conn) -> None:
        """CANCEL_WAIT: forget the connection's waits, answer WAIT_CANCELED (torch's reply,
        also when nothing was pending)."""
        self.state.cancel(conn)
        conn.out.append(_CANCELED)

    # -- the requests ------------------------------------------------------------------------------

    def _op_unknown(self, conn, buf, pos: int, end: int) -> int:
        raise ProtocolError(f"unknown opcode 0x{buf[pos]:02x}")

    def _op_validate(self, conn, buf, pos: int, end: int) -> int:
        raise CloseConnection("VALIDATE sent twice")

    def _op_set(self, conn, buf, pos: int, end: int) -> int:
        key, value, r = read_key_value(buf, pos + 1, end, self.limits)
        if r >= 0:
            if key == SEQUENCE_KEY:
                return self._sequenced(conn, buf, r, end, value)
            self.state.set(key, value)
        return r

    def _sequenced(self, conn, buf, pos: int, end: int, header: bytes) -> int:
        """A sequence header and the write after it (sessions.py): run the write unless its
        session applied it already; then answer the reply it got then."""
        if pos >= end:
            return -(pos + 1)
        op = buf[pos]
        if op not in SEQUENCED_OPS:
            r = decode(buf, pos, end, self.limits)[2]
            if r < 0:  # (read whole first, so that the close is clean: nothing left unread)
                return r
            raise ProtocolError(f"a sequence header before opcode 0x{op:02x}, which is not a sequenced write")
        if len(header) != 24:
            raise ProtocolError(f"a sequence header of {len(header)} bytes (24 expected)")
        session = header[:16]
        (seq,) = _unpack_u64(header, 16)
        state = self.state
        entry = state.sessions.get(session)
        if entry is not None and seq <= entry.seq:
            return self._repeated(conn, buf, pos, end, op, session, seq, entry.seq, entry.reply)
        out = conn.out
        mark = len(out)
        state.begin_group()
        try:  # (the write's own handler: it runs nothing until the write has fully arrived)
            r = self._ops[op](conn, buf, pos, end)
        except BaseException:
            state.end_group(None)
            raise
        if r < 0:
            state.end_group(None)
            return r
        reply = out[-1] if len(out) == mark + 1 else b"".join(out[mark:])
        more = state.sessions.record(session, seq, reply)
        if more is not None:
            state.end_group(more)
        return r

    def _repeated(self, conn, buf, pos: int, end: int, op: int, session: bytes, seq: int, last: int,
                  reply: bytes) -> int:
        """A sequenced write its session applied already (``last`` is the session's last
        number, ``reply`` what it answered): answered as then, not applied again."""
        _op, _fields, r = decode(buf, pos, end, self.limits)
        if r < 0:
            return r
        if seq < last:
            # a write without reply the client re-sends with those after it (it could not know
            # that the server ran them): applied before, nothing to answer
            if op in _UNANSWERED:
                return r
            raise ProtocolError(f"write {seq} of session {session.hex()} re-sent after its write {last}")
        if op == _BARRIER:  # counted already: wait for the rest without counting again
            key, world_size, _ = read_key_i64(buf, pos + 1, r, self.limits)
            if self.state.rejoin_barrier(conn, key, world_size):
                conn.out.append(_STOP)
            return r
        if reply:
            conn.out.append(reply)  # applied before: the same answer, not again
        return r

    def _op_get(self, conn, buf, pos: int, end: int) -> int:
        key, r = read_key(buf, pos + 1, end, self.limits)
        if r >= 0:
            value = self._get(key)
            if value is None:
                conn.out.append(self._incarnation if key == INCARNATION_KEY else _EMPTY_BLOB)
            else:
                n = len(value)
                if n <= COPY_MAX:
                    conn.out.append(_pack_u64(n) + value)
                else:
                    conn.out += (_pack_u64(n), memoryview(value))
                    conn.refs = True
        return r

    def _op_add(self, conn, buf, pos: int, end: int) -> int:
        key, delta, r = read_key_i64(buf, pos + 1, end, self.limits)
        if r >= 0:
            value = self.state.add(key, delta)
            conn.out.append(_pack_i64(value))
            if key == WORKER_COUNTER_KEY:
                self.on_worker(conn, value)
        return r

    def _op_compare_set(self, conn, buf, pos: int, end: int) -> int:
        key, expected, desired, r = read_key_2blobs(buf, pos + 1, end, self.limits)
        if r >= 0:
            value = self.state.compare_set(key, expected, desired)
            conn.out.append(_pack_u64(len(value)) + value)
        return r

    def _op_check(self, conn, buf, pos: int, end: int) -> int:
        keys, r = read_keys(buf, pos + 1, end, self.limits)
        if r >= 0:
            if len(keys) == 1 and keys[0] == ORDERED_WAIT_PROBE_KEY:
                conn.out.append(_READY)
            else:
                conn.out.append(_READY if self.state.check(keys) else _NOT_READY)
        return r

    def _op_wait(self, conn, buf, pos: int, end: int) -> int:
        keys, r = read_keys(buf, pos + 1, end, self.limits)
        if r >= 0 and self.state.wait(conn, keys):
            conn.out.append(_STOP)
        return r

    def _op_num_keys(self, conn, buf, pos: int, end: int) -> int:
        conn.out.append(_pack_i64(self.state.num_keys()))
        return pos + 1

    def _op_delete_key(self, conn, buf, pos: int, end: int) -> int:
        key, r = read_key(buf, pos + 1, end, self.limits)
        if r >= 0:
            conn.out.append(_pack_i64(1 if self.state.delete(key) else 0))
        return r

    def _op_append(self, conn, buf, pos: int, end: int) -> int:
        key, value, r = read_key_value(buf, pos + 1, end, self.limits)
        if r >= 0:
            self.state.append(key, value)
        return r

    def _op_multi_get(self, conn, buf, pos: int, end: int) -> int:
        keys, r = read_keys(buf, pos + 1, end, self.limits)
        if r >= 0:
            out = conn.out
            get = self._get
            for key in keys:
                value = get(key)
                if value is None:
                    out.append(_EMPTY_BLOB)
                else:
                    n = len(value)
                    out.append(_pack_u64(n))
                    if n <= COPY_MAX:
                        out.append(value)  # (joined with the rest when sent)
                    else:
                        out.append(memoryview(value))
                        conn.refs = True
        return r

    def _op_multi_set(self, conn, buf, pos: int, end: int) -> int:
        pairs, r = read_pairs(buf, pos + 1, end, self.limits)
        if r >= 0:
            self.state.multi_set(pairs)
        return r

    def _op_cancel_wait(self, conn, buf, pos: int, end: int) -> int:
        self.cancel_wait(conn)
        return pos + 1

    def _op_ping(self, conn, buf, pos: int, end: int) -> int:
        nonce, r = read_u32(buf, pos + 1, end, self.limits)
        if r >= 0:
            conn.out.append(buf[pos + 1 : r])
        return r

    def _op_queue_push(self, conn, buf, pos: int, end: int) -> int:
        key, value, r = read_key_value(buf, pos + 1, end, self.limits)
        if r >= 0:
            self.state.queue_push(key, value)
        return r

    def _op_queue_pop(self, conn, buf, pos: int, end: int) -> int:
        key, r = read_key(buf, pos + 1, end, self.limits)
        if r >= 0:
            length, value = self.state.queue_pop(key)
            conn.out.append(_ZERO_I64 if value is None else _pack_i64(length) + _pack_u64(len(value)) + value)
        return r

    def _op_queue_len(self, conn, buf, pos: int, end: int) -> int:
        key, r = read_key(buf, pos + 1, end, self.limits)
        if r >= 0:
            conn.out.append(_pack_i64(self.state.queue_len(key)))
        return r

    def _op_list_keys(self, conn, buf, pos: int, end: int) -> int:
        out = conn.out
        data = self.state.data
        out.append(_pack_i64(len(data)))
        for key in data:
            out.append(_pack_u64(len(key)))
            out.append(key)
        return pos + 1

    def _op_barrier(self, conn, buf, pos: int, end: int) -> int:
        key, world_size, r = read_key_i64(buf, pos + 1, end, self.limits)
        if r >= 0 and self.state.barrier(conn, key, world_size):
            conn.out.append(_STOP)
        return r
