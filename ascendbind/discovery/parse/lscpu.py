"""Parsers for ``lscpu -e`` and ``lscpu``. Pure: text in, frozen values out.

``lscpu -e`` is a header-driven table (``CPU NODE SOCKET CORE L1d:L1i:L2:L3
ONLINE MAXMHZ MINMHZ``; which columns appear, and in which order, depends on the
host and the util-linux version: single-node hosts and some containers print no
NODE column). Its column names and values never contain a space, numbers are
right-aligned under their names; cells are read by column name through the
header's layout (columns.py), so columns this parser does not read are ignored.
Offline CPUs print ``-`` in the topology cells and ``no`` under ONLINE. ``lscpu`` is ``Key: value`` lines;
only the keys the planner needs are kept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...values.cpulist import parse_cpulist
from ...errors import ParseError
from ...values.frozen import frozen_map
from ...values.model import CpuInfo
from .cells import count
from .columns import Layout, header_layout, read_row

__all__ = ["LscpuSummary", "parse_lscpu_e", "parse_lscpu", "SRC_LSCPU", "SRC_LSCPU_E"]

SRC_LSCPU = "lscpu"
SRC_LSCPU_E = "lscpu -e"

_DASH = {"-", ""}


def parse_lscpu_e(text: str, source: str = SRC_LSCPU_E) -> tuple[CpuInfo, ...]:
    """One CpuInfo per row, sorted by CPU number."""
    layout: Layout | None = None
    out: dict[int, CpuInfo] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if layout is None:
            layout = header_layout(line, words=True)
            if not layout.has("CPU"):
                raise ParseError(source, "expected the 'CPU NODE SOCKET CORE ...' header", line=lineno, text=line)
            continue
        n_cells, n_cols = len(line.split()), len(layout.columns)
        if n_cells > n_cols:
            raise ParseError(source, f"row has {n_cells} cells, header has {n_cols}", line=lineno, text=line)
        row = read_row(layout, line, source, lineno)

        def num(col: str) -> int | None:
            raw = row.get(col)
            if raw is None:
                return None  # the header has no such column
            raw = row.need(col)  # a row may stop early only after the columns we read
            return None if raw in _DASH else count(raw, source, col, lineno, line)

        cpu = num("CPU")
        if cpu is None:
            raise ParseError(source, "row without a CPU number", line=lineno, text=line)
        if cpu in out:
            raise ParseError(source, f"CPU {cpu} listed twice", line=lineno, text=line)
        online_raw = (row.need("ONLINE") if layout.has("ONLINE") else "yes").lower()
        if online_raw not in ("yes", "no", "y", "n"):
            raise ParseError(source, f"ONLINE {online_raw!r} is neither yes nor no", line=lineno, text=line)
        out[cpu] = CpuInfo(
            cpu=cpu,
            node=num("NODE"),
            socket=num("SOCKET"),
            core=num("CORE"),
            online=online_raw.startswith("y"),
        )
    if layout is None:
        raise ParseError(source, "no 'CPU ...' header found (empty output)")
    if not out:
        raise ParseError(source, "header without any CPU rows (truncated output?)")
    return tuple(out[c] for c in sorted(out))


@dataclass(frozen=True)
class LscpuSummary:
    architecture: str | None
    model_name: str | None
    cpu_count: int | None
    online_cpus: frozenset[int] | None
    threads_per_core: int | None
    numa_node_count: int | None
    # "NUMA node3 CPU(s):" lines; empty when lscpu printed none
    numa_cpus: Mapping[int, frozenset[int]] = field(default_factory=frozen_map)


_NUMA_LINE = re.compile(r"^NUMA node([0-9]+) CPU\(s\)$")


def parse_lscpu(text: str, source: str = SRC_LSCPU) -> LscpuSummary:
    values: dict[str, tuple[str, int, str]] = {}
    numa: dict[int, frozenset[int]] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        key, sep, value = line.partition(":")
        if not sep:
            continue  # section titles of newer util-linux ("Caches (sum of all):" has a colon and no value)
        key, value = key.strip(), value.strip()
        m = _NUMA_LINE.match(key)
        if m:
            try:
                numa[int(m.group(1))] = parse_cpulist(value)
            except ValueError as exc:
                raise ParseError(source, f"{key}: {exc}", line=lineno, text=line) from None
            continue
        values.setdefault(key, (value, lineno, line))

    def number(key: str) -> int | None:
        if key not in values:
            return None
        raw, lineno, line = values[key]
        if raw in _DASH:
            return None
        return count(raw, source, key, lineno, line)

    online: frozenset[int] | None = None
    if "On-line CPU(s) list" in values:
        raw, lineno, line = values["On-line CPU(s) list"]
        try:
            online = parse_cpulist(raw)
        except ValueError as exc:
            raise ParseError(source, f"On-line CPU(s) list: {exc}", line=lineno, text=line) from None
    if not values and not numa:
        raise ParseError(source, "no 'Key: value' lines (empty output)")
    return LscpuSummary(
        architecture=values.get("Architecture", (None,))[0],
        model_name=values.get("Model name", (None,))[0],
        cpu_count=number("CPU(s)"),
        online_cpus=online,
        threads_per_core=number("Thread(s) per core"),
        numa_node_count=number("NUMA node(s)"),
        numa_cpus=frozen_map(numa),
    )
