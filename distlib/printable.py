"""Text that came from elsewhere (a store's value, another node's record), made safe to print.

Why: a store anyone on the network may write to hands its values to our log lines and our
terminal. A newline there forges a line of our output ("distlib-run: the job succeeded"), an
escape sequence moves the cursor or clears the screen, a right-to-left override reorders what
the reader sees. ``printable`` escapes every such character the way Python's ``repr`` would
(``\\n``, ``\\x1b``, ``\\u202e``) and leaves everything else, other scripts included, as it is.
"""

from __future__ import annotations

import unicodedata

#: Unicode's format characters that reorder text (bidirectional overrides and isolates).
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _unsafe(ch: str) -> bool:
    return ch in _BIDI or unicodedata.category(ch) in ("Cc", "Zl", "Zp")


def printable(text: str) -> str:
    """``text`` with control characters, line and paragraph separators and bidirectional
    overrides escaped (module docstring); backslashes are doubled only when something else is
    escaped, so clean text comes back unchanged."""
    if not any(_unsafe(ch) for ch in text):
        return text
    out = []
    for ch in text:
        if ch in _NAMED:
            out.append(_NAMED[ch])
        elif _unsafe(ch):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)
