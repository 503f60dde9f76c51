"""Decimal numbers in text the daemon does not write itself. Pure.

``str.isdigit`` and ``int()`` accept the digits of every script: ``"٣".isdigit()``
and ``int("５")`` is 5, ``"²".isdigit()`` is true while ``int("²")`` fails, and
``int()`` also takes signs, surrounding blanks and ``_`` between digits. The kernel,
npu-smi and the Ascend runtimes write ASCII digits only; so ids, indexes and pids
read from a worker's environment, a tool's output or a file are ASCII digits or
refused, and an id a person reads as "3" is the id the daemon acts on.
"""

from __future__ import annotations

__all__ = ["is_ascii_digits", "ascii_int"]


def is_ascii_digits(text: str) -> bool:
    """Whether ``text`` is one or more of ``0``-``9`` and nothing else."""
    return text.isascii() and text.isdigit()


def ascii_int(text: str) -> int | None:
    """The non-negative integer ``text`` spells in ASCII digits, or None for anything else
    (empty, a sign, blanks, ``_``, another script's digits)."""
    return int(text) if text.isascii() and text.isdigit() else None
