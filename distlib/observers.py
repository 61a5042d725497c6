"""Hooks through which an observer outside the library hears what this process does.

The testing harness (``distlib.testing``) sets them in the ranks it starts, so that a fault can
fire when rank r enters collective #k, at that point in every run. Nobody else sets them: each
is None, and the cost without an observer is one attribute test per operation.
"""

from __future__ import annotations

from typing import Callable, Optional

#: ``collective_entered(op_name)``: this process enters a collective or point-to-point operation
#: (its arguments checked, nothing sent yet). It may block: the harness holds a rank there until
#: the fault due at that point is in place.
collective_entered: Optional[Callable[[str], None]] = None
