"""Parsers for ``npu-smi`` text. Pure: text in, frozen values out, no I/O.

Every table is read by column name through the header's layout (columns.py):
cells are separated by ``|`` borders, by runs of two or more spaces or a tab, or
by the header's column offsets. A column these parsers do not know, of one word
or several, is ignored wherever it stands, and a value with single spaces
(``Ascend 910B3``) is one cell in any column. What real hosts print:

* ``npu-smi info -m``: a header naming the columns (``NPU ID``, ``Chip ID``,
  ``Chip Logic ID``, ``Chip Phy-ID`` on A3, ``Chip Name``), rows aligned under
  it, usually after a leading tab. ``Mcu`` rows and rows whose logic id is
  ``-``/``NA`` are not compute dies. The Ascend 950 prints ``NPU ID  Slot ID
  Chip ID  Chip Phy-ID  Chip Name`` and no ``Chip Logic ID``: its logic id is
  the NPU ID.
* ``npu-smi info``: a box-drawn status table, then the process table whose
  header is either ``NPU  Chip | Process id | ...`` (A2, A3, 310P: card and chip)
  or ``NPU ID | Process id | ...`` (950: the logic id), optionally with a
  ``Process id in container`` column. ``No running processes found in NPU N``
  rows and ``[WARNING]`` lines are noise.
* ``npu-smi info -t topo``: a matrix whose header lists the row labels
  (``NPU<n>`` or ``Phy-ID<n>``), then maybe ``CPU Affinity`` and other columns;
  affinity cells may carry spaces after commas, or ``NA``/``-``. A ``Legend:``
  block follows.
* ``npu-smi info -t board -i C [-c D]``: ``key : value`` lines, one of them
  ``PCIe Bus Info`` (some firmware prints ``PCIeBusInfo``).

Anything else is a ParseError naming the command and the 1-based line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...values.cpulist import parse_cpulist
from ...errors import ParseError
from ...values.model import NpuChip
from .cells import count
from .columns import Layout, Row, blank_before, header_layout, read_row

__all__ = [
    "SRC_CHIP_MAP",
    "SRC_INFO",
    "SRC_TOPO",
    "RawProcessRow",
    "TopoRow",
    "TopoTable",
    "parse_chip_map",
    "parse_process_table",
    "parse_topo",
    "parse_board",
    "board_source",
]

SRC_CHIP_MAP = "npu-smi info -m"
SRC_INFO = "npu-smi info"
SRC_TOPO = "npu-smi info -t topo"

_ABSENT = {"-", "NA", "N/A", "--"}


def _is_noise(stripped: str) -> bool:
    # npu-smi appends "[WARNING] ..." / "[ERROR] ..." notes to otherwise good output
    return not stripped or stripped.startswith("[WARNING]") or stripped.startswith("[INFO]")


# ---------------------------------------------------------------- npu-smi info -m


def parse_chip_map(text: str, source: str = SRC_CHIP_MAP) -> tuple[NpuChip, ...]:
    """Compute dies from ``npu-smi info -m``, in printed order."""
    layout: Layout | None = None
    chips: list[NpuChip] = []
    seen_logic: dict[int, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if _is_noise(stripped):
            continue
        if layout is None:
            layout = header_layout(line)
            if not layout.has("NPU ID"):
                raise ParseError(source, "expected the 'NPU ID  Chip ID ...' header", line=lineno, text=line)
            for need in ("Chip ID", "Chip Name"):
                if not layout.has(need):
                    raise ParseError(source, f"header has no {need!r} column", line=lineno, text=line)
            continue
        row = read_row(layout, line, source, lineno)
        card = row.number("NPU ID")
        chip = row.number("Chip ID")
        name = row.need("Chip Name")
        raw_logic = row.get("Chip Logic ID")
        if raw_logic is None:
            logic = card  # Ascend 950: the NPU ID is the logic id
        elif raw_logic.upper() in _ABSENT:
            continue  # Mcu, or a die the driver does not expose
        else:
            logic = row.number("Chip Logic ID")
        if name.lower() == "mcu":
            continue
        phy: int | None = None
        raw_phy = row.get("Chip Phy-ID")
        if raw_phy and raw_phy.upper() not in _ABSENT:
            phy = row.number("Chip Phy-ID")
        if logic in seen_logic:
            row.fail(f"logic id {logic} appears twice (first on line {seen_logic[logic]})")
        seen_logic[logic] = lineno
        chips.append(NpuChip(card=card, chip=chip, logic_id=logic, name=name, phy_id=phy))
    if layout is None:
        raise ParseError(source, "no 'NPU ID  Chip ID ...' header found (empty or truncated output)")
    return tuple(chips)


# ---------------------------------------------------------------- npu-smi info (process table)


@dataclass(frozen=True)
class RawProcessRow:
    """One process row as printed. ``chip`` is None for the 950 ``NPU ID`` form,
    where ``card`` already is the logic id."""

    card: int
    chip: int | None
    pid: int
    name: str
    container_pid: int | None = None
    memory_mb: int | None = None


def _process_form(layout: Layout) -> str | None:
    """How the header names the NPU: "card+chip" (two columns), "card chip" (one
    column holding both numbers), "npu_id" (950: the logic id), or None."""
    if layout.has("NPU") and (layout.has("Chip") or layout.has("Chip ID")):
        return "card+chip"
    if layout.has("NPU Chip") or layout.has("NPU Chip ID"):
        return "card chip"
    if layout.has("NPU ID") or layout.has("NPU"):
        return "npu_id"
    return None


def _optional_count(row: Row, name: str) -> int | None:
    raw = row.get(name)
    if not raw or raw.upper() in _ABSENT:
        return None
    return row.number(name)


def parse_process_table(text: str, source: str = SRC_INFO) -> tuple[RawProcessRow, ...]:
    """The process table of ``npu-smi info`` (the status table above it is skipped)."""
    layout: Layout | None = None
    form = ""
    rows: list[RawProcessRow] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if layout is None:
            if stripped.startswith("|") and "process id" in stripped.lower():
                layout = header_layout(line)
                form = _process_form(layout) or ""
                if not form:
                    raise ParseError(source, "process header has no 'NPU' / 'NPU ID' column", line=lineno, text=line)
                if not layout.has("Process id"):
                    raise ParseError(source, "process header has no 'Process id' column", line=lineno, text=line)
            continue
        if not stripped.startswith("|"):
            continue  # "+====+" borders, blank lines, trailing [WARNING] notes
        if stripped.strip("| ").lower().startswith("no running processes found"):
            continue
        row = read_row(layout, line, source, lineno)
        chip: int | None
        if form == "card+chip":
            if not row.get("NPU") or not (row.get("Chip") or row.get("Chip ID")):
                row.fail("expected '<npu> <chip>' in the first cell")
            card = row.number("NPU")
            chip = row.number("Chip" if layout.has("Chip") else "Chip ID")
        elif form == "card chip":
            both = (row.get("NPU Chip") or row.get("NPU Chip ID") or "").split()
            if len(both) != 2:
                row.fail("expected '<npu> <chip>' in the first cell")
            card = count(both[0], source, "NPU", lineno, line)
            chip = count(both[1], source, "Chip", lineno, line)
        else:
            npu_col = "NPU ID" if layout.has("NPU ID") else "NPU"
            if len(row.need(npu_col).split()) != 1:
                row.fail("expected one NPU ID in the first cell")
            card = row.number(npu_col)
            chip = None
        pid = row.number("Process id")
        cpid = _optional_count(row, "Process id in container")
        mem = _optional_count(row, "Process memory(MB)")
        rows.append(RawProcessRow(card, chip, pid, row.get("Process name") or "", cpid, mem))
    if layout is None:
        raise ParseError(source, "no process table ('| NPU ... | Process id |') found (truncated output?)")
    return tuple(rows)


# ---------------------------------------------------------------- npu-smi info -t topo

_LABEL = re.compile(r"^(NPU|Phy-ID)([0-9]+)$")
_TOKEN = re.compile(r"\S+")


@dataclass(frozen=True)
class TopoRow:
    """One matrix row: ``kind`` is "NPU" or "Phy-ID", ``index`` the number after it.
    ``affinity`` is None when the column is absent or the cell is NA/-."""

    kind: str
    index: int
    affinity: frozenset[int] | None


@dataclass(frozen=True)
class TopoTable:
    rows: tuple[TopoRow, ...]
    has_affinity: bool


def parse_topo(text: str, source: str = SRC_TOPO) -> TopoTable:
    """The ``npu-smi info -t topo`` matrix. A device that cannot report topology
    prints a sentence and no matrix: that is an empty table, not an error.

    The matrix cells (the row label, then one link word per label in the header:
    ``X``, ``HCCS``, ``PIX``, ``SIO`` ...) are single words and taken in order; what
    follows them is read against the header's layout of the columns after the
    labels, so ``CPU Affinity`` is found by name among any others.
    """
    labels: list[str] | None = None
    extra = Layout((), 1)
    rows: list[TopoRow] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("Legend"):
            break
        if _is_noise(stripped):
            continue
        spans = list(_TOKEN.finditer(line))
        tokens = [s.group() for s in spans]
        if labels is None:
            n = 0
            while n < len(tokens) and _LABEL.match(tokens[n]):
                n += 1
            if n == 0:
                continue  # preamble ("This device does not support querying topo.")
            rest = line[spans[n - 1].end() :]
            if "X" in rest.split():
                # a row's own cell is "X": this is a matrix row, and no header came before it
                raise ParseError(source, "matrix row before the header row", line=lineno, text=line)
            labels = tokens[:n]
            extra = header_layout(blank_before(line, spans[n - 1].end()))
            continue
        m = _LABEL.match(tokens[0])
        if not m:
            raise ParseError(source, "expected a row starting with NPU<n> or Phy-ID<n>", line=lineno, text=line)
        if len(tokens) < 1 + len(labels):
            raise ParseError(
                source, f"row has {len(tokens) - 1} link cells, header has {len(labels)}", line=lineno, text=line
            )
        tail = blank_before(line, spans[len(labels)].end())
        if not extra.columns:
            if tail.strip():
                raise ParseError(source, "row has more cells than the header", line=lineno, text=line)
            rows.append(TopoRow(kind=m.group(1), index=int(m.group(2)), affinity=None))
            continue
        row = read_row(extra, tail, source, lineno, shown=line)
        affinity: frozenset[int] | None = None
        if extra.has("CPU Affinity"):
            # affinity lists may carry a space after each comma
            cell = re.sub(r",\s+", ",", row.need("CPU Affinity"))
            if cell.upper() not in _ABSENT:
                try:
                    affinity = parse_cpulist(cell)
                except ValueError as exc:
                    row.fail(f"bad CPU Affinity: {exc}")
        rows.append(TopoRow(kind=m.group(1), index=int(m.group(2)), affinity=affinity))
    if labels is not None and not rows:
        raise ParseError(source, "topo header without any rows (truncated output?)")
    return TopoTable(rows=tuple(rows), has_affinity=extra.has("CPU Affinity"))


# ---------------------------------------------------------------- npu-smi info -t board

_BUS_LINE = re.compile(r"^\s*PCIe\s*Bus\s*Info\s*:\s*(.*?)\s*$", re.IGNORECASE)
_PCI_ADDR = re.compile(r"^(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$", re.IGNORECASE)


def board_source(card: int, chip: int | None = None) -> str:
    return f"npu-smi info -t board -i {card}" + (f" -c {chip}" if chip is not None else "")


def parse_board(text: str, source: str = "npu-smi info -t board") -> str | None:
    """The PCI address from ``PCIe Bus Info``, lower case with its domain
    ("0000:c1:00.0"); None when the line is absent or says NA."""
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _BUS_LINE.match(line)
        if not m:
            continue
        value = m.group(1)
        if not value or value.upper() in _ABSENT:
            return None
        a = _PCI_ADDR.match(value)
        if not a:
            raise ParseError(source, f"PCIe Bus Info {value!r} is not a PCI address", line=lineno, text=line)
        domain = a.group(1) or "0000"
        return f"{domain}:{a.group(2)}:{a.group(3)}.{a.group(4)}".lower()
    return None
