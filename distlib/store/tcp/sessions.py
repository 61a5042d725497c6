"""``Sessions``: each distlib client session's last applied write and its reply, so that a
write the client re-sends after a reconnect is answered, not applied again (exactly once).

A distlib client names a session (16 random bytes) and numbers its writes that are not
idempotent (ADD, COMPARE_SET, APPEND, MULTI_SET, DELETE_KEY, QUEUE_PUSH, QUEUE_POP): the
sequence header goes just before the write, in the same send (docs/wire-protocol.md,
"Sequenced writes"). A client has at most one write with a reply in flight, so one entry per
session is enough: a repeated (session, seq) gets the stored reply; a lower seq is a write
without reply (APPEND, MULTI_SET, QUEUE_PUSH) re-sent with the ones after it, applied before,
and skipped (a lower seq of a write with a reply is a client's bug: refused).

Bounds: a session is forgotten after ``SESSION_IDLE_S`` without a sequenced write (it must
outlive any reconnect window: the client retries for at most its store timeout, 30 minutes
for a process group, so two hours leaves room for a master that takes long to come back), and
beyond ``MAX_SESSIONS`` sessions or ``MAX_REPLY_BYTES`` bytes of stored replies the least
recently used go first. Each forgotten session is reported (the journal records it).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, List, Optional

from .journal_records import Session, forget_record, session_record

#: Idle time after which a session is forgotten (seconds).
SESSION_IDLE_S = 2 * 3600.0
#: Sessions kept at most (a job of 10,000 ranks with a few stores each fits).
MAX_SESSIONS = 1 << 16
#: Bytes of stored replies kept at most (a COMPARE_SET's reply is a value).
MAX_REPLY_BYTES = 64 << 20
_NEVER = float("inf")


class Sessions:
    """The table (session id -> Session, least recently used first)."""

    def __init__(self, table: Optional["collections.OrderedDict[bytes, Session]"] = None,
                 clock: Callable[[], float] = time.time, idle_s: float = SESSION_IDLE_S,
                 max_sessions: int = MAX_SESSIONS, max_reply_bytes: int = MAX_REPLY_BYTES):
        self.table = table if table is not None else collections.OrderedDict()
        self.clock = clock
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self.max_reply_bytes = max_reply_bytes
        self.reply_bytes = sum(len(s.reply) for s in self.table.values())
        #: Whether ``record`` returns the journal's records (a server with a state directory).
        self.journaled = False
        self._expires_at = _NEVER  # no session idles out before this (set by expire)
        self.expire()

    def __len__(self) -> int:
        return len(self.table)

    def get(self, session: bytes) -> Optional[Session]:
        return self.table.get(session)

    def record(self, session: bytes, seq: int, reply: bytes) -> Optional[List[bytes]]:
        """``session`` applied write ``seq``, which answered ``reply``: remember it. Returns the
        journal records that say so (and which sessions this forgot) when ``journaled``."""
        now = self.clock()
        table = self.table
        old = table.pop(session, None)
        if old is not None:
            self.reply_bytes -= len(old.reply)
        table[session] = Session(seq, reply, now)  # (a new entry: a snapshot's copy shares the old ones)
        self.reply_bytes += len(reply)
        if self._expires_at == _NEVER:  # the table was empty: this one idles out first
            self._expires_at = now + self.idle_s
        if now <= self._expires_at and len(table) <= self.max_sessions and \
                self.reply_bytes <= self.max_reply_bytes:  # nothing to forget (expire's test, inline)
            return [session_record(session, seq, now, reply)] if self.journaled else None
        forgotten = self.expire(now)
        return [session_record(session, seq, now, reply)] + forgotten if self.journaled else None

    def expire(self, now: Optional[float] = None) -> List[bytes]:
        """Forget idle sessions and those past the bounds; the records that say so."""
        now = self.clock() if now is None else now
        table = self.table
        forgotten: List[bytes] = []
        while table:
            session, entry = next(iter(table.items()))
            if (now - entry.used <= self.idle_s and len(table) <= self.max_sessions
                    and self.reply_bytes <= self.max_reply_bytes):
                break
            del table[session]
            self.reply_bytes -= len(entry.reply)
            forgotten.append(forget_record(session))
        # No session idles out before the oldest one does: record() need not look before then.
        self._expires_at = next(iter(table.values())).used + self.idle_s if table else _NEVER
        return forgotten
