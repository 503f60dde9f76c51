"""Where the columns of a printed text table are, read from its header (pure).

Every table discovery reads (``npu-smi info -m``, the ``npu-smi info`` process
table, ``npu-smi info -t topo``, ``lscpu -e``) is aligned text whose header
names the columns. A parser asks this module for a :class:`Layout` of the header
and then for each row's cells, and reads the cells *by column name*. So a column
the parser does not know — one word or several — is carried along and ignored,
the columns may come in any order, and the header, not a list of names built into
the code, says where one column ends and the next begins.

The rules, which hold for header and rows alike:

* ``|`` is a hard border. It cuts a line into sections (npu-smi draws boxes);
  a row's n-th section is read against the header's n-th section, and a row with
  another number of sections is malformed. Blank text outside the outer borders
  is not a section.
* Inside a section, a run of two or more spaces or a tab ends a name or a cell; a
  single space does not, so ``Chip Logic ID`` is one column and ``Ascend 910B3``
  one cell. lscpu (util-linux) separates its column names by single spaces and
  never puts a space inside a name or a value: ``words=True`` makes every word a
  column of the header and a cell of a row.
* A row section with exactly as many cells as its header section has columns is
  read in order. Otherwise (an empty cell, or a cell that shares a gap with its
  neighbour) each cell is placed by its offset: under the column whose name it
  overlaps (lscpu right-aligns numbers under their names), else under the last
  column that starts at or before it (npu-smi left-aligns; the last column runs to
  the end of the line). Cells that land under one column are joined with a space;
  the parser then finds a value it cannot read, and says where.
* Offsets count display columns, with tabs expanded to stops of 8 the way a
  terminal shows them, so a header and rows that share a leading tab line up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ParseError

__all__ = ["Column", "Layout", "header_layout", "split_row", "blank_before"]

_GAP_CELL = re.compile(r"[^ \t](?:[^ \t]| (?=[^ \t]))*")
_WORD = re.compile(r"[^ \t]+")
TAB = 8


@dataclass(frozen=True)
class Column:
    """One header column: its name and where the name lies in its section."""

    name: str
    section: int
    start: int
    end: int


@dataclass(frozen=True)
class Layout:
    columns: tuple[Column, ...]
    sections: int
    words: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def find(self, name: str) -> int | None:
        """Index of the first column called ``name``, ignoring case and spacing."""
        want = _norm(name)
        for i, c in enumerate(self.columns):
            if _norm(c.name) == want:
                return i
        return None

    def has(self, name: str) -> bool:
        return self.find(name) is not None


def _norm(name: str) -> str:
    return " ".join(name.split()).lower()


def _display_columns(line: str) -> list[int]:
    """Display column of every character of ``line``, plus one past the end."""
    cols, col = [], 0
    for ch in line:
        cols.append(col)
        col = (col // TAB + 1) * TAB if ch == "\t" else col + 1
    cols.append(col)
    return cols


def _sections(line: str) -> list[tuple[int, int]]:
    """(start, end) raw indices of the text between ``|`` borders."""
    cuts = [i for i, ch in enumerate(line) if ch == "|"]
    if not cuts:
        return [(0, len(line))]
    spans = [(a + 1, b) for a, b in zip(cuts, cuts[1:])]
    if line[: cuts[0]].strip():
        spans.insert(0, (0, cuts[0]))
    if line[cuts[-1] + 1 :].strip():
        spans.append((cuts[-1] + 1, len(line)))
    return spans


def _pieces(line: str, span: tuple[int, int], cols: list[int], words: bool) -> list[tuple[str, int, int]]:
    """(text, start, end) of each cell of one section; offsets relative to the section."""
    a, b = span
    base = cols[a]
    pattern = _WORD if words else _GAP_CELL
    return [(m.group(), cols[a + m.start()] - base, cols[a + m.end()] - base) for m in pattern.finditer(line[a:b])]


def header_layout(line: str, *, words: bool = False) -> Layout:
    """The columns a header line names, in printed order."""
    cols = _display_columns(line)
    spans = _sections(line)
    columns = [
        Column(text, n, start, end)
        for n, span in enumerate(spans)
        for text, start, end in _pieces(line, span, cols, words)
    ]
    return Layout(tuple(columns), len(spans), words)


def split_row(layout: Layout, line: str, source: str, lineno: int) -> tuple[str, ...]:
    """One cell per column of ``layout`` ("" where the row has none there).

    Raises ParseError (naming ``source`` and ``lineno``) only when the row's ``|``
    sections do not match the header's: anything finer is the parser's to judge.
    """
    cols = _display_columns(line)
    spans = _sections(line)
    if len(spans) != layout.sections:
        raise ParseError(source, f"row has {len(spans)} cells, header has {layout.sections}", line=lineno, text=line)
    cells: list[list[str]] = [[] for _ in layout.columns]
    for n, span in enumerate(spans):
        under = [i for i, c in enumerate(layout.columns) if c.section == n]
        pieces = _pieces(line, span, cols, layout.words)
        if not under:
            continue
        if len(pieces) == len(under):
            for i, (text, _, _) in zip(under, pieces):
                cells[i].append(text)
            continue
        for text, start, end in pieces:
            cells[_column_of(layout, under, start, end)].append(text)
    return tuple(" ".join(parts) for parts in cells)


def _column_of(layout: Layout, under: list[int], start: int, end: int) -> int:
    for i in under:
        c = layout.columns[i]
        if start < c.end and c.start < end:
            return i
    owner = under[0]
    for i in under:
        if layout.columns[i].start <= start:
            owner = i
    return owner


def blank_before(line: str, end: int) -> str:
    """``line`` with every character before raw index ``end`` turned into a space,
    tabs kept, so what follows keeps its display offsets (used to read the part of
    a row after cells a parser has already taken by position)."""
    head = "".join(ch if ch == "\t" else " " for ch in line[:end])
    return head + line[end:]
