"""CPU lists and kernel masks, both directions, no I/O.

Two textual forms of a CPU set appear on a Linux host:

* the *cpulist* ("0-3,8,10-11"), printed by ``Cpus_allowed_list``, cgroup
  ``cpuset.cpus`` and ``npu-smi info -t topo`` (which sometimes puts a space
  after each comma);
* the *hex mask* ("00000000,0000000f"), comma-separated 32-bit groups, most
  significant first, as the kernel prints ``/proc/irq/<n>/smp_affinity``.

Invariants (round-trip tested): ``parse_cpulist(format_cpulist(s)) == s`` for every
set of CPU numbers up to ``MAX_CPU``, and ``parse_mask(format_mask(s)) == s`` for
every finite set of non-negative ints.
"""

from __future__ import annotations

from collections.abc import Iterable

from .digits import ascii_int

__all__ = ["parse_cpulist", "format_cpulist", "parse_mask", "format_mask", "bits", "MAX_CPU", "IdRanges"]

# no kernel numbers CPUs this far (NR_CPUS is at most 8192 on any architecture)
MAX_CPU = (1 << 16) - 1


class IdRanges:
    """Numbers gathered range by range under two bounds: none past ``largest``, and no more
    than ``largest + 1`` named in all, repeats included, each range checked before it is
    expanded, so that no text (``0-99999999``, or one range a thousand times) costs more
    than a list of every number allowed."""

    PAST = "past"  # a range ends past ``largest``
    TOO_MANY = "too_many"  # the ranges so far name more than ``largest + 1``

    def __init__(self, largest: int) -> None:
        self.largest, self.ids, self.named = largest, set(), 0

    def add(self, lo: int, hi: int) -> str | None:
        """Adds ``lo``..``hi`` (inclusive); or, adding nothing, the bound it breaks."""
        if hi > self.largest:
            return self.PAST
        self.named += hi - lo + 1
        if self.named > self.largest + 1:
            return self.TOO_MANY
        self.ids.update(range(lo, hi + 1))
        return None


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse "0-3, 8,10-11" into a frozenset. Empty or blank text is the empty set.

    Raises ValueError naming the bad item; callers wrap it with the source. CPU
    numbers are ASCII digits up to ``MAX_CPU``, and a list naming more than
    ``MAX_CPU + 1`` CPUs (repeats included) is refused, each range before it is
    expanded: a tool's garbled ``0-99999999`` costs nothing.
    """
    text = text.strip()
    if not text:
        return frozenset()
    cpus = IdRanges(MAX_CPU)
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"empty item in cpu list {text[:80]!r}")
        lo, sep, hi = item.partition("-")
        start = ascii_int(lo.strip())
        end = ascii_int(hi.strip()) if sep else start
        if start is None or end is None:
            raise ValueError(f"bad item {item[:40]!r} in cpu list {text[:80]!r}")
        if end < start:
            raise ValueError(f"bad range {item[:40]!r} in cpu list {text[:80]!r}")
        broken = cpus.add(start, end)
        if broken == IdRanges.PAST:
            raise ValueError(f"CPU {end} in cpu list {text[:80]!r} is past the largest CPU number, {MAX_CPU}")
        if broken == IdRanges.TOO_MANY:
            raise ValueError(f"cpu list {text[:80]!r} names more than {MAX_CPU + 1} CPUs")
    return frozenset(cpus.ids)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format a set of CPUs as the kernel does: sorted, ranges collapsed."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_mask(text: str) -> frozenset[int]:
    """Parse a kernel hex mask ("00000000,00000003") into a set of CPUs."""
    text = text.strip()
    if not text:
        raise ValueError("empty cpu mask")
    value = 0
    for group in text.split(","):
        group = group.strip()
        if not group or len(group) > 8:
            raise ValueError(f"bad group {group!r} in cpu mask {text!r}")
        try:
            value = (value << 32) | int(group, 16)
        except ValueError:
            raise ValueError(f"bad group {group!r} in cpu mask {text!r}") from None
    return frozenset(bits(value))


def bits(value: int) -> tuple[int, ...]:
    """The positions of the set bits of a non-negative int, ascending (CPUs of a mask,
    NUMA nodes of a bitmask)."""
    out = []
    while value:
        low = value & -value
        out.append(low.bit_length() - 1)
        value ^= low
    return tuple(out)


def format_mask(cpus: Iterable[int], min_groups: int = 1) -> str:
    """Format CPUs as comma-separated 32-bit hex groups, most significant first.

    ``min_groups`` pads with leading zero groups so the width matches what the
    kernel prints for the host (``nr_cpu_ids`` bits); the kernel accepts any width.
    """
    value = 0
    for cpu in cpus:
        if cpu < 0:
            raise ValueError(f"negative cpu {cpu}")
        value |= 1 << cpu
    groups: list[str] = []
    while value or not groups:
        groups.append(f"{value & 0xFFFFFFFF:08x}")
        value >>= 32
    while len(groups) < min_groups:
        groups.append("00000000")
    return ",".join(reversed(groups))
