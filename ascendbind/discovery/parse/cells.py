"""Cell-level helpers shared by the table parsers (pure)."""

from __future__ import annotations

from ...values.digits import ascii_int, is_ascii_digits
from ...errors import ParseError

__all__ = ["count"]


def count(cell: str, source: str, what: str, lineno: int, line: str) -> int:
    """A non-negative integer cell (an id, a CPU number, a pid) in ASCII digits, or a
    ParseError naming the column, the source and the line."""
    text = cell.strip()
    value = ascii_int(text)
    if value is not None:
        return value
    if text[:1] == "-" and is_ascii_digits(text[1:]):
        raise ParseError(source, f"{what} {cell!r} is negative", line=lineno, text=line)
    raise ParseError(source, f"{what} {cell!r} is not a number", line=lineno, text=line)
