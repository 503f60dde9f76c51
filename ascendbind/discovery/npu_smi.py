"""Parsers for ``npu-smi`` text. Pure: text in, frozen values out, no I/O.

What real hosts print, and what these parsers therefore accept (SPEC §1):

* ``npu-smi info -m``: a header naming the columns (``NPU ID``, ``Chip ID``,
  ``Chip Logic ID``, ``Chip Phy-ID`` on A3, ``Chip Name``), rows aligned with
  runs of spaces (often a leading tab). ``Chip Name`` may itself contain a space
  ("Ascend 910B3"), so the id columns are single tokens and the name takes the
  rest. ``Mcu`` rows and rows whose logic id is ``-``/``NA`` are not compute
  dies. The Ascend 950 prints no ``Chip Logic ID``: its logic id is the NPU ID.
* ``npu-smi info``: a box-drawn status table, then the process table whose
  header is either ``NPU  Chip | Process id | ...`` (A2, A3, 310P: card and chip)
  or ``NPU ID | Process id | ...`` (950: the logic id), optionally with a
  ``Process id in container`` column. ``No running processes found in NPU N``
  rows and ``[WARNING]`` lines are noise.
* ``npu-smi info -t topo``: a matrix whose header lists the row labels
  (``NPU<n>`` or ``Phy-ID<n>``) and maybe ``CPU Affinity``; affinity cells may
  carry spaces after commas, or ``NA``/``-``. A ``Legend:`` block follows.
* ``npu-smi info -t board -i C [-c D]``: ``key : value`` lines, one of them
  ``PCIe Bus Info`` (some firmware prints ``PCIeBusInfo``).

Anything else is a ParseError naming the command and the 1-based line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..cpulist import parse_cpulist
from ..errors import ParseError
from ..model import NpuChip
from .cells import count

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

# longest names first so "Chip Logic ID" is not read as "Chip" + ...
_CHIP_COLUMNS = re.compile(r"NPU ID|Chip Logic ID|Chip Phy-ID|Chip ID|Chip Name|\S+")


def parse_chip_map(text: str, source: str = SRC_CHIP_MAP) -> tuple[NpuChip, ...]:
    """Compute dies from ``npu-smi info -m``, in printed order."""
    lines = text.splitlines()
    header: list[str] | None = None
    chips: list[NpuChip] = []
    seen_logic: dict[int, int] = {}
    for lineno, line in enumerate(lines, 1):
        stripped = line.strip()
        if _is_noise(stripped):
            continue
        if header is None:
            if "NPU ID" in stripped and "Chip" in stripped:
                header = _CHIP_COLUMNS.findall(stripped)
                for need in ("NPU ID", "Chip ID", "Chip Name"):
                    if need not in header:
                        raise ParseError(source, f"header has no {need!r} column", line=lineno, text=line)
                continue
            raise ParseError(source, "expected the 'NPU ID  Chip ID ...' header", line=lineno, text=line)
        tokens = stripped.split()
        name_at = header.index("Chip Name")
        n_after = len(header) - name_at - 1
        if len(tokens) < len(header):
            raise ParseError(source, f"row has {len(tokens)} cells, header has {len(header)}", line=lineno, text=line)
        cells = dict(zip(header[:name_at], tokens[:name_at]))
        name = " ".join(tokens[name_at : len(tokens) - n_after])
        cells.update(zip(header[name_at + 1 :], tokens[len(tokens) - n_after :]))
        card = count(cells["NPU ID"], source, "NPU ID", lineno, line)
        chip = count(cells["Chip ID"], source, "Chip ID", lineno, line)
        if "Chip Logic ID" in cells:
            raw_logic = cells["Chip Logic ID"]
            if raw_logic.upper() in _ABSENT:
                continue  # Mcu, or a die the driver does not expose
            logic = count(raw_logic, source, "Chip Logic ID", lineno, line)
        else:
            logic = card  # Ascend 950: the NPU ID is the logic id
        if name.lower() == "mcu":
            continue
        phy: int | None = None
        raw_phy = cells.get("Chip Phy-ID")
        if raw_phy is not None and raw_phy.upper() not in _ABSENT:
            phy = count(raw_phy, source, "Chip Phy-ID", lineno, line)
        if logic in seen_logic:
            raise ParseError(
                source, f"logic id {logic} appears twice (first on line {seen_logic[logic]})", line=lineno, text=line
            )
        seen_logic[logic] = lineno
        chips.append(NpuChip(card=card, chip=chip, logic_id=logic, name=name, phy_id=phy))
    if header is None:
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


def _cells(line: str) -> list[str]:
    parts = [p.strip() for p in line.strip().split("|")]
    # "| a | b |" splits into ['', 'a', 'b', '']
    if parts and parts[0] == "":
        parts = parts[1:]
    if parts and parts[-1] == "":
        parts = parts[:-1]
    return parts


def parse_process_table(text: str, source: str = SRC_INFO) -> tuple[RawProcessRow, ...]:
    """The process table of ``npu-smi info`` (the status table above it is skipped)."""
    header: list[str] | None = None
    npu_form = ""
    rows: list[RawProcessRow] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if header is None:
            if stripped.startswith("|") and "process id" in stripped.lower():
                header = [" ".join(c.split()).lower() for c in _cells(stripped)]
                first = header[0] if header else ""
                if first in ("npu chip", "npu chip id"):
                    npu_form = "card+chip"
                elif first in ("npu id", "npu"):
                    npu_form = "npu_id"
                else:
                    raise ParseError(source, f"unknown first process column {first!r}", line=lineno, text=line)
                if "process id" not in header:
                    raise ParseError(source, "process header has no 'Process id' column", line=lineno, text=line)
            continue
        if not stripped.startswith("|"):
            continue  # "+====+" borders, blank lines, trailing [WARNING] notes
        cells = _cells(stripped)
        if cells and cells[0].lower().startswith("no running processes found"):
            continue
        if len(cells) != len(header):
            raise ParseError(
                source, f"process row has {len(cells)} cells, header has {len(header)}", line=lineno, text=line
            )
        col = dict(zip(header, cells))
        npu_cell = cells[0].split()
        if npu_form == "card+chip":
            if len(npu_cell) != 2:
                raise ParseError(source, "expected '<npu> <chip>' in the first cell", line=lineno, text=line)
            card = count(npu_cell[0], source, "NPU", lineno, line)
            chip: int | None = count(npu_cell[1], source, "Chip", lineno, line)
        else:
            if len(npu_cell) != 1:
                raise ParseError(source, "expected one NPU ID in the first cell", line=lineno, text=line)
            card = count(npu_cell[0], source, "NPU ID", lineno, line)
            chip = None
        pid = count(col["process id"], source, "Process id", lineno, line)
        cpid: int | None = None
        raw_cpid = col.get("process id in container")
        if raw_cpid is not None and raw_cpid.upper() not in _ABSENT and raw_cpid:
            cpid = count(raw_cpid, source, "Process id in container", lineno, line)
        mem: int | None = None
        raw_mem = col.get("process memory(mb)")
        if raw_mem and raw_mem.upper() not in _ABSENT:
            mem = count(raw_mem, source, "Process memory(MB)", lineno, line)
        rows.append(RawProcessRow(card, chip, pid, col.get("process name", ""), cpid, mem))
    if header is None:
        raise ParseError(source, "no process table ('| NPU ... | Process id |') found (truncated output?)")
    return tuple(rows)


# ---------------------------------------------------------------- npu-smi info -t topo

_LABEL = re.compile(r"^(NPU|Phy-ID)(\d+)$")


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
    prints a sentence and no matrix: that is an empty table, not an error."""
    labels: list[str] | None = None
    extra_cols: list[str] = []
    rows: list[TopoRow] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("Legend"):
            break
        if _is_noise(stripped):
            continue
        spans = list(re.finditer(r"\S+", stripped))
        tokens = [s.group() for s in spans]
        if labels is None:
            n = 0
            while n < len(tokens) and _LABEL.match(tokens[n]):
                n += 1
            if n == 0:
                continue  # preamble ("This device does not support querying topo.")
            rest = stripped[spans[n - 1].end() :].strip()
            if "X" in rest.split():
                # a row's own cell is "X": this is a matrix row, and no header came before it
                raise ParseError(source, "matrix row before the header row", line=lineno, text=line)
            labels = tokens[:n]
            extra_cols = [c for c in re.split(r"\s{2,}", rest) if c] if rest else []
            continue
        m = _LABEL.match(tokens[0])
        if not m:
            raise ParseError(source, "expected a row starting with NPU<n> or Phy-ID<n>", line=lineno, text=line)
        if len(tokens) < 1 + len(labels):
            raise ParseError(
                source, f"row has {len(tokens) - 1} link cells, header has {len(labels)}", line=lineno, text=line
            )
        # affinity lists may carry a space after each comma: glue them before splitting
        rest = re.sub(r",\s+", ",", " ".join(tokens[1 + len(labels) :]))
        rest_cells = rest.split()
        affinity: frozenset[int] | None = None
        if "CPU Affinity" in extra_cols:
            at = extra_cols.index("CPU Affinity")
            if at >= len(rest_cells):
                raise ParseError(source, "row has no CPU Affinity cell", line=lineno, text=line)
            cell = rest_cells[at]
            if cell.upper() not in _ABSENT:
                try:
                    affinity = parse_cpulist(cell)
                except ValueError as exc:
                    raise ParseError(source, f"bad CPU Affinity: {exc}", line=lineno, text=line) from None
        elif len(rest_cells) > len(extra_cols):
            raise ParseError(source, "row has more cells than the header", line=lineno, text=line)
        rows.append(TopoRow(kind=m.group(1), index=int(m.group(2)), affinity=affinity))
    if labels is not None and not rows:
        raise ParseError(source, "topo header without any rows (truncated output?)")
    return TopoTable(rows=tuple(rows), has_affinity="CPU Affinity" in extra_cols)


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
