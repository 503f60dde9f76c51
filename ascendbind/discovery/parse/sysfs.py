"""Parsers for the few sysfs files discovery reads. Pure: text in, values out.

* ``/sys/devices/system/node/node<N>/distance``: one line of integers, the
  SLIT distances from node N to every node in ascending node order.
* cpulist files (``node<N>/cpulist``, ``cpu/online``, ``node/online``,
  cgroup ``cpuset.effective_cpus`` / ``cpuset.cpus.effective``).
"""

from __future__ import annotations

from ...values.cpulist import parse_cpulist
from ...errors import ParseError

__all__ = ["parse_node_distance", "parse_cpulist_file"]


def parse_node_distance(text: str, source: str = "/sys/devices/system/node/node0/distance") -> tuple[int, ...]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) != 1:
        raise ParseError(source, f"expected one line of distances, got {len(lines)}")
    out: list[int] = []
    for cell in lines[0].split():
        try:
            value = int(cell)
        except ValueError:
            raise ParseError(source, f"distance {cell!r} is not a number", line=1, text=lines[0]) from None
        if value <= 0:
            raise ParseError(source, f"distance {cell!r} is not positive", line=1, text=lines[0])
        out.append(value)
    return tuple(out)


def parse_cpulist_file(text: str, source: str) -> frozenset[int]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1:
        raise ParseError(source, f"expected one cpu list line, got {len(lines)}", line=2, text=lines[1])
    try:
        return parse_cpulist(lines[0] if lines else "")
    except ValueError as exc:
        raise ParseError(source, str(exc), line=1, text=lines[0]) from None
