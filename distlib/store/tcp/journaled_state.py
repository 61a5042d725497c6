"""``JournaledState``: the key-value state of a server with a state directory, each change
also recorded as a journal frame (journal.py writes them once per loop turn).

A subclass, so that a server without ``--state-dir`` runs the plain state's methods and pays
nothing for the journal. Each override calls the plain method and records what it did (an
ADD as the SET of the number it wrote: journal_records.py); a change the state refuses
raises before it is recorded. A sequenced write (sessions.py) is one group: its effects and
its session's new entry go in one frame, so a crash keeps both or neither.
"""

from __future__ import annotations

import collections
from typing import Callable, List, Optional, Sequence, Tuple

from . import journal_records as records
from .journal import Journal
from .journal_records import Image
from .sessions import Sessions
from .state import KeyValueState, Waiter

_frame = records.frame
_set_record = records.set_record


class JournaledState(KeyValueState):
    """KeyValueState whose changes go to ``journal.pending``; starts from ``image`` (what
    the journal replayed)."""

    def __init__(self, journal: Journal, image: Image, on_release: Callable[[Waiter], None], *args, **kwargs):
        super().__init__(on_release, *args, **kwargs)
        self.data = image.data
        self.queues = image.queues
        self.sessions = Sessions(image.sessions)
        self.journal = journal
        self._frames = journal.pending
        self._group: Optional[List[bytes]] = None
        journal.copy_state = self.copy_image

    def _emit(self, record: bytes) -> None:
        group = self._group
        if group is None:
            self._frames.append(_frame(record))
        else:
            group.append(record)

    # -- sequenced writes (one frame each) ---------------------------------------------------------

    def begin_group(self) -> None:
        self._group = []

    def end_group(self, more: Optional[List[bytes]]) -> None:
        group, self._group = self._group, None
        if more is not None and group is not None:
            self._frames.append(_frame(b"".join(group + more)))

    # -- the changes -------------------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        super().set(key, value)
        self._emit(_set_record(key, value))

    def multi_set(self, pairs: Sequence[Tuple[bytes, bytes]]) -> None:
        super().multi_set(pairs)
        body = b"".join([_set_record(k, v) for k, v in pairs])
        if self._group is None:
            self._frames.append(_frame(body))  # all the keys, or none
        else:
            self._group.append(body)

    def append(self, key: bytes, value: bytes) -> None:
        super().append(key, value)
        self._emit(records.append_record(key, value))

    def delete(self, key: bytes) -> bool:
        deleted = super().delete(key)
        if deleted:
            self._emit(records.delete_record(key))
        return deleted

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        before = self.data.get(key)
        result = super().compare_set(key, expected, desired)
        after = self.data.get(key)
        if after is not before:
            self._emit(_set_record(key, after))
        return result

    def add(self, key: bytes, delta: int, what: str = "ADD") -> int:
        value = super().add(key, delta, what)
        self._emit(_set_record(key, self.data[key]))
        return value

    def add_many(self, key: bytes, deltas: Sequence[int]) -> List[int]:
        values = super().add_many(key, deltas)
        if values:
            self._emit(_set_record(key, self.data[key]))
        return values

    def queue_push(self, key: bytes, value: bytes) -> None:
        super().queue_push(key, value)
        self._emit(records.push_record(key, value))

    def queue_pop(self, key: bytes) -> Tuple[int, Optional[bytes]]:
        length, value = super().queue_pop(key)
        if value is not None:
            self._emit(records.pop_record(key))
        return length, value

    # -- compaction --------------------------------------------------------------------------------

    def copy_image(self) -> Image:
        """The live state, copied (the snapshot thread writes it while the loop goes on)."""
        image = Image()
        image.data = dict(self.data)
        image.queues = {k: collections.deque(q) for k, q in self.queues.items()}
        image.sessions = collections.OrderedDict(self.sessions.table)  # (entries are never changed)
        return image
