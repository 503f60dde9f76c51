"""What the scheduler says a thread and a CPU got: text in, numbers out. Pure.

* ``/proc/<pid>/task/<tid>/schedstat``: three numbers, the time the thread ran
  on a CPU (ns), the time it waited on a run queue, runnable but not running
  (ns: the run-queue delay), and how many times it ran. The kernel keeps them
  whenever it is built with ``CONFIG_SCHED_INFO`` (every distribution kernel);
  the ``kernel.sched_schedstats`` switch is not needed.
* ``/proc/<pid>/task/<tid>/status``: ``nonvoluntary_ctxt_switches``, how often
  the thread was taken off its CPU while it still wanted to run.
* ``/proc/<pid>/task/<tid>/stat``: field 39, the CPU the thread last ran on (read
  only for a worker driving several NPUs, to tell which NPU's CPUs the thread is on).
* ``/proc/stat``: per CPU, the time spent in each state, in ``USER_HZ`` ticks;
  ``user nice system idle iowait irq softirq steal guest guest_nice``.
* ``/proc/interrupts``: the per-CPU count of every IRQ (discovery/parse/irqs.py reads
  the names from the same file).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ...values.digits import is_ascii_digits

K = TypeVar("K")

__all__ = ["ThreadSched", "parse_schedstat", "parse_nonvoluntary", "parse_cpu_busy", "parse_interrupt_counts",
           "parse_interrupt_counts_by",
           "parse_stat_cpu", "BUSY_FIELDS"]


@dataclass(frozen=True)
class ThreadSched:
    """One thread's scheduler counters, as read at one moment."""

    cpu_ns: int
    delay_ns: int
    nonvoluntary: int


def parse_schedstat(text: str) -> tuple[int, int] | None:
    """(CPU time ns, run-queue delay ns) from a schedstat line; None when malformed."""
    fields = text.split()
    if len(fields) < 2 or not (is_ascii_digits(fields[0]) and is_ascii_digits(fields[1])):
        return None
    return int(fields[0]), int(fields[1])


def parse_nonvoluntary(text: str) -> int | None:
    """``nonvoluntary_ctxt_switches`` from a status file (the last line on current
    kernels, so the search starts from the end); None when absent."""
    key = "\nnonvoluntary_ctxt_switches:"
    at = text.rfind(key)
    if at < 0:
        return None
    value = text[at + len(key):].split("\n", 1)[0].strip()
    return int(value) if is_ascii_digits(value) else None


# the states that are a task's or an interrupt's time on the CPU; idle and iowait are
# not, steal is the hypervisor's, guest and guest_nice are already inside user and nice
BUSY_FIELDS = (0, 1, 2, 5, 6)  # user nice system irq softirq


def parse_cpu_busy(text: str, cpus: Iterable[int]) -> dict[int, int]:
    """CPU -> busy ticks (``BUSY_FIELDS`` summed) from ``/proc/stat``, for the CPUs asked
    that it lists (an offline CPU has no line)."""
    want = {f"cpu{c}" for c in cpus}
    out: dict[int, int] = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            if line.startswith("intr"):
                break  # the CPU lines come first; the long intr line and the rest are not read
            continue
        name, _, rest = line.partition(" ")
        if name not in want:
            continue
        fields = rest.split()
        try:
            out[int(name[3:])] = sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
        except ValueError:
            continue
    return out


def parse_interrupt_counts(text: str, cpus: Iterable[int]) -> dict[int, int]:
    """IRQ -> how often it fired on ``cpus``, from ``/proc/interrupts``, numbered IRQs only
    (parse_interrupt_counts_by with one group)."""
    return parse_interrupt_counts_by(text, {0: cpus})[0]


def parse_interrupt_counts_by(text: str, groups: Mapping[K, Iterable[int]]) -> dict[K, dict[int, int]]:
    """Per group of CPUs, IRQ -> how often it fired on them, from one ``/proc/interrupts``
    text, numbered IRQs only (the file is read and split once, however many groups).

    Columns are matched by the header's ``CPUn`` names (an offline CPU has no column).
    The architecture rows (LOC, RES, CAL, TLB, …) are left out: they fire on every CPU
    whatever runs there (the timer tick above all), so they say nothing about who else
    uses a pool. A malformed row is skipped."""
    lines = text.splitlines()
    cols: dict[K, list[int]] = {}
    start = 0
    for start, line in enumerate(lines):
        names = line.split()
        if names and names[0].startswith("CPU"):
            index = {int(n[3:]): i for i, n in enumerate(names) if n[3:].isdigit()}
            cols = {key: sorted(index[c] for c in set(cpus) if c in index) for key, cpus in groups.items()}
            break
    out: dict[K, dict[int, int]] = {key: {} for key in groups}
    last = max((c[-1] for c in cols.values() if c), default=None)
    if last is None:
        return out
    for line in lines[start + 1:]:
        key, sep, rest = line.partition(":")
        key = key.strip()
        if not sep or not is_ascii_digits(key):
            continue
        tokens = rest.split(None, last + 1)
        for group, c in cols.items():
            if not c:
                continue
            try:
                out[group][int(key)] = sum(int(tokens[i]) for i in c)
            except (ValueError, IndexError):
                continue
    return out


def parse_stat_cpu(text: str) -> int | None:
    """The CPU a thread last ran on: field 39 of its ``stat``. The second field, the
    command, is in parentheses and may hold spaces and parentheses itself: fields are
    counted from after its last ``)`` (field 3 on)."""
    fields = text.rpartition(")")[2].split()
    if len(fields) < 37 or not is_ascii_digits(fields[36]):
        return None
    return int(fields[36])
