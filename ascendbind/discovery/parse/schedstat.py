"""What the scheduler says a thread and a CPU got: text in, numbers out. Pure.

* ``/proc/<pid>/task/<tid>/schedstat``: three numbers, the time the thread ran
  on a CPU (ns), the time it waited on a run queue, runnable but not running
  (ns: the run-queue delay), and how many times it ran. The kernel keeps them
  whenever it is built with ``CONFIG_SCHED_INFO`` (every distribution kernel);
  the ``kernel.sched_schedstats`` switch is not needed.
* ``/proc/<pid>/task/<tid>/status``: ``nonvoluntary_ctxt_switches``, how often
  the thread was taken off its CPU while it still wanted to run.
* ``/proc/stat``: per CPU, the time spent in each state, in ``USER_HZ`` ticks;
  ``user nice system idle iowait irq softirq steal guest guest_nice``.
* ``/proc/interrupts``: the per-CPU count of every IRQ (discovery/parse/irqs.py reads
  the names from the same file).
* a worker's cgroup path, which names the pod and the container a kubelet
  started it in, and the log file names the kubelet keeps for each container.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ...values.digits import is_ascii_digits

__all__ = ["ThreadSched", "parse_schedstat", "parse_nonvoluntary", "parse_cpu_busy", "parse_interrupt_counts",
           "pod_of_cgroup", "parse_container_log", "BUSY_FIELDS"]


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
    """IRQ -> how often it fired on ``cpus``, from ``/proc/interrupts``, numbered IRQs only.

    Columns are matched by the header's ``CPUn`` names (an offline CPU has no column).
    The architecture rows (LOC, RES, CAL, TLB, …) are left out: they fire on every CPU
    whatever runs there (the timer tick above all), so they say nothing about who else
    uses a pool. A malformed row is skipped."""
    lines = text.splitlines()
    cols: list[int] = []
    start = 0
    for start, line in enumerate(lines):
        names = line.split()
        if names and names[0].startswith("CPU"):
            want = set(cpus)
            cols = [i for i, n in enumerate(names) if n[3:].isdigit() and int(n[3:]) in want]
            break
    out: dict[int, int] = {}
    if not cols:
        return out
    for line in lines[start + 1:]:
        key, sep, rest = line.partition(":")
        key = key.strip()
        if not sep or not is_ascii_digits(key):
            continue
        tokens = rest.split(None, cols[-1] + 1)
        try:
            out[int(key)] = sum(int(tokens[i]) for i in cols)
        except (ValueError, IndexError):
            continue
    return out


# kubelet's cgroup names: systemd driver ``kubepods-burstable-pod<uid>.slice`` with the
# uid's dashes as underscores, cgroupfs driver ``/kubepods/burstable/pod<uid>``; the
# container's scope ``cri-containerd-<id>.scope`` / ``crio-<id>.scope`` / ``docker-<id>.scope``
# or, with cgroupfs, a last component that is the bare 64-hex id
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_CONTAINER = re.compile(r"^(?:(?:cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?$")


def pod_of_cgroup(path: str) -> tuple[str | None, str | None]:
    """(pod UID, container ID) named by a kubelet-made cgroup path; (None, None) outside a pod."""
    uid = container = None
    for part in path.split("/"):
        m = _POD.search(part)
        if m:
            uid = m.group(1).replace("_", "-")
            continue
        m = _CONTAINER.match(part)
        if m and uid is not None:
            container = m.group(1)
    return uid, container


# /var/log/containers/<pod>_<namespace>_<container>-<64-hex id>.log: the kubelet's link
# to each container's log, named with everything an operator joins on
_LOG = re.compile(r"^([a-z0-9][-a-z0-9.]{0,252})_([a-z0-9][-a-z0-9]{0,62})_([a-z0-9][-a-z0-9]{0,62})-([0-9a-f]{64})\.log$")


def parse_container_log(name: str) -> tuple[str, str, str, str] | None:
    """(pod name, namespace, container name, container ID) from a container log's file name."""
    m = _LOG.match(name)
    return (m.group(1), m.group(2), m.group(3), m.group(4)) if m else None
