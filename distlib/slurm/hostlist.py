"""Slurm's host list syntax, expanded: ``node[01-03,7],gpu[1-2]-ib`` → the host names, in order.

Slurm writes node lists compressed (``SLURM_JOB_NODELIST``, ``SLURM_STEP_NODELIST``;
``scontrol show hostnames`` expands them). The rules, as Slurm 22.05's ``scontrol show
hostnames`` applies them (tests/containers/test_slurm_cluster.py compares the two):

* hosts are separated by commas outside brackets (also by spaces, tabs and newlines); empty
  items are skipped;
* ``prefix[ranges]``: each range is ``N`` or ``LO-HI`` (``LO <= HI``), ranges are separated by
  commas, and the numbers keep the width of ``LO`` as written, zero-padded (``[01-10]`` →
  ``01 .. 10``, ``[1-10]`` → ``1 .. 10``, ``[001-3]`` → ``001 .. 003``);
* a host may have several groups, each with text before it (``rack[1-2]-n[01-02]``), but no
  text after its last group: Slurm 22.05 calls ``b[1-2]-ib`` an invalid host list;
* several groups expand in Slurm's order: the last group varies fastest, then the first,
  the second, ... up to the next-to-last, which varies slowest (``r[1-2]n[1-2]`` → ``r1n1,
  r1n2, r2n1, r2n2``; ``x[1-2]y[3-4]z[5-6]`` → ``x1y3z5, x1y3z6, x2y3z5, x2y3z6, x1y4z5, ...``);
* duplicates are kept, order is as written.

Anything else (an unclosed or nested bracket, an empty group or range, a reversed range, a
non-digit bound, text after a group, a range of more than ``MAX_RANGE`` hosts, one host
expanding to more than ``MAX_HOSTS``) is a ``HostlistError`` that quotes the list and says
where it is wrong: a node list read from the environment is the caller's variable, and
guessing would send a job to the wrong host. (Slurm itself reads a few of these, such as an
unclosed bracket, as some other name.)
"""

from __future__ import annotations

import itertools
import re
from typing import List, Tuple

#: Slurm refuses larger ranges (hostlist.c's MAX_RANGE): a typo like ``[1-100000000]`` is an
#: error, not a list that fills memory.
MAX_RANGE = 64 * 1024
#: The most names one bracketed host may expand to (several groups multiply).
MAX_HOSTS = 1 << 20
_SEPARATORS = ", \t\n"
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(ValueError):
    """A host list that is not in Slurm's syntax; the message quotes it and says why."""


def expand(text: str) -> List[str]:
    """The host names of Slurm host list ``text``, in order (duplicates kept).

    Args:
        text: a host list such as ``node[1-4,7]`` or ``a1,b[01-02]-ib``.
    Returns:
        the names; ``[]`` for an empty or blank list.
    Raises:
        HostlistError: the list is malformed (the message quotes it and says where).
    """
    hosts: List[str] = []
    for item in _split_hosts(text):
        hosts.extend(_expand_item(item, text))
    return hosts


def _split_hosts(text: str) -> List[str]:
    """The comma-separated items of ``text``, commas inside brackets kept in their item."""
    items: List[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"the host list {text!r} has a '[' inside brackets at position {i}: bracket "
                                    "groups cannot be nested")
        elif char == "]":
            if depth == 0:
                raise HostlistError(f"the host list {text!r} has a ']' without its '[' at position {i}")
            depth -= 1
        elif char in _SEPARATORS and depth == 0:
            items.append(text[start:i])
            start = i + 1
        elif char in _SEPARATORS:
            if char != ",":
                raise HostlistError(f"the host list {text!r} has white space inside brackets at position {i}")
    if depth:
        raise HostlistError(f"the host list {text!r} has a '[' that is never closed")
    items.append(text[start:])
    return [item for item in items if item]


Range = Tuple[int, int, int]  # (low, high, width)


def _parse_item(item: str, text: str) -> Tuple[List[Tuple[str, List[Range]]], str]:
    """``prefix[ranges]...suffix`` → ([(prefix, ranges), ...], suffix)."""
    groups: List[Tuple[str, List[Range]]] = []
    rest = item
    while "[" in rest:
        prefix, _, after = rest.partition("[")
        inside, _, rest = after.partition("]")
        groups.append((prefix, [_parse_range(part, item, text) for part in inside.split(",")]))
    if groups and rest:
        raise HostlistError(f"{item!r} in the host list {text!r} has {rest!r} after its last ']': Slurm's host "
                            "lists allow text before a bracket group, not after the last one")
    return groups, rest


def _parse_range(part: str, item: str, text: str) -> Range:
    where = f"in {item!r} of the host list {text!r}" if item != text else f"in the host list {text!r}"
    if not part:
        raise HostlistError(f"an empty range {where}: write [N], [LO-HI] or [A,LO-HI,...]")
    match = _RANGE.fullmatch(part)
    if match is None:
        raise HostlistError(f"the range {part!r} {where} is not N or LO-HI with decimal numbers")
    low_text, high_text = match.group(1), match.group(2)
    low = int(low_text)
    high = int(high_text) if high_text is not None else low
    if high < low:
        raise HostlistError(f"the range {part!r} {where} runs backwards ({low} > {high})")
    if high - low + 1 > MAX_RANGE:
        raise HostlistError(f"the range {part!r} {where} names {high - low + 1} hosts, more than Slurm's limit "
                            f"of {MAX_RANGE}")
    return low, high, len(low_text)


def _expand_item(item: str, text: str) -> List[str]:
    """The names of one comma-separated item."""
    groups, suffix = _parse_item(item, text)
    total = 1
    for _prefix, ranges in groups:
        total *= sum(high - low + 1 for low, high, _width in ranges)
    if total > MAX_HOSTS:
        raise HostlistError(f"{item!r} in the host list {text!r} names {total} hosts (more than {MAX_HOSTS})")
    numbers = [[f"{n:0{width}d}" for low, high, width in ranges for n in range(low, high + 1)]
               for _prefix, ranges in groups]
    # Slurm's order, slowest first: the next-to-last group down to the first, then the last
    order = list(range(len(groups) - 2, -1, -1)) + [len(groups) - 1] if groups else []
    names = []
    for chosen in itertools.product(*(numbers[i] for i in order)):
        picked = dict(zip(order, chosen, strict=True))
        names.append("".join(prefix + picked[i] for i, (prefix, _ranges) in enumerate(groups)) + suffix)
    return names
