"""Cell-level helpers shared by the table parsers (pure)."""

from __future__ import annotations

from ..errors import ParseError

__all__ = ["count"]


def count(cell: str, source: str, what: str, lineno: int, line: str) -> int:
    """A non-negative integer cell (an id, a CPU number, a pid), or a ParseError naming
    the column, the source and the line."""
    try:
        value = int(cell)
    except ValueError:
        raise ParseError(source, f"{what} {cell!r} is not a number", line=lineno, text=line) from None
    if value < 0:
        raise ParseError(source, f"{what} {cell!r} is negative", line=lineno, text=line)
    return value
