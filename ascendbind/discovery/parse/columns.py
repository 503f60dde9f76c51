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
from dataclasses import dataclass, field

from ...errors import ParseError
from .cells import count

__all__ = ["Column", "Layout", "Row", "header_layout", "split_row", "read_row", "blank_before"]

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
    # normalised name -> first column of that name; section -> its columns (built once, read per row)
    _index: dict[str, int] = field(init=False, repr=False, compare=False)
    _under: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        for i, c in enumerate(self.columns):
            index.setdefault(_norm(c.name), i)
        for i, c in enumerate(self.columns):
            # the name as printed finds its column without normalising (the common lookup)
            index.setdefault(c.name, index[_norm(c.name)])
        under = tuple(tuple(i for i, c in enumerate(self.columns) if c.section == n) for n in range(self.sections))
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_under", under)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def find(self, name: str) -> int | None:
        """Index of the first column called ``name``, ignoring case and spacing."""
        found = self._index.get(name)
        return found if found is not None else self._index.get(_norm(name))

    def has(self, name: str) -> bool:
        return self.find(name) is not None


def _norm(name: str) -> str:
    return " ".join(name.split()).lower()


def _display_columns(line: str) -> list[int] | None:
    """Display column of every character of ``line``, plus one past the end; None
    when the line has no tab and every character is one column wide."""
    if "\t" not in line:
        return None
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


def _pieces(line: str, span: tuple[int, int], cols: list[int] | None, words: bool) -> list[tuple[str, int, int]]:
    """(text, start, end) of each cell of one section; offsets relative to the section."""
    a, b = span
    pattern = _WORD if words else _GAP_CELL
    if cols is None:
        return [(m.group(), m.start() - a, m.end() - a) for m in pattern.finditer(line, a, b)]
    base = cols[a]
    return [(m.group(), cols[m.start()] - base, cols[m.end()] - base) for m in pattern.finditer(line, a, b)]


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
    spans = _sections(line)
    if len(spans) != layout.sections:
        raise ParseError(source, f"row has {len(spans)} cells, header has {layout.sections}", line=lineno, text=line)
    cells = [""] * len(layout.columns)
    for n, span in enumerate(spans):
        under = layout._under[n]
        if not under:
            continue
        texts = (_WORD if layout.words else _GAP_CELL).findall(line, *span)
        if len(texts) == len(under):
            for i, text in zip(under, texts):
                cells[i] = text
            continue
        for text, start, end in _pieces(line, span, _display_columns(line), layout.words):
            i = _column_of(layout, under, start, end)
            cells[i] = f"{cells[i]} {text}" if cells[i] else text
    return tuple(cells)


class Row:
    """One row's cells by column name, and the errors a parser raises about them
    (each names the source, the line number and the line as printed)."""

    def __init__(self, layout: Layout, cells: tuple[str, ...], source: str, lineno: int, line: str) -> None:
        self.layout, self.cells = layout, cells
        self.source, self.lineno, self.line = source, lineno, line

    def get(self, name: str) -> str | None:
        """The cell under ``name`` ("" when the row has none there); None when the
        header has no such column."""
        i = self.layout.find(name)
        return None if i is None else self.cells[i]

    def need(self, name: str) -> str:
        """The cell under a column the header has; an empty one is an error."""
        cell = self.get(name)
        if not cell:
            self.fail(f"row has no {name!r} cell (the header has that column)")
        return cell

    def number(self, name: str) -> int:
        return count(self.need(name), self.source, name, self.lineno, self.line)

    def fail(self, message: str):
        raise ParseError(self.source, message, line=self.lineno, text=self.line)


def read_row(layout: Layout, line: str, source: str, lineno: int, *, shown: str | None = None) -> Row:
    """``split_row`` wrapped for reading by name; ``shown`` is the line errors quote
    when ``line`` is an edited copy of it."""
    return Row(layout, split_row(layout, line, source, lineno), source, lineno, line if shown is None else shown)


def _column_of(layout: Layout, under: tuple[int, ...], start: int, end: int) -> int:
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
