"""What preempts the role threads and what their wake-ups wait for: the kernel's own
scheduler events on the worker's CPUs, while an arm runs (``bench/effect.py --trace``).

Only in the two-node guest, which is disposable: tracing is host-wide (tracefs's
``tracing_cpumask``, its events, its buffer). ``SchedTrace`` records, on the CPUs
given, ``sched_switch``, ``sched_wakeup``, ``softirq_entry``/``softirq_exit`` and
``workqueue_execute_start``; ``attribute`` (pure) reads the text trace:

* *preempted by*: each switch away from a role thread that was still runnable
  (``prev_state=R``), by the task switched to (its name with the CPU number
  dropped: ``ksoftirqd/3`` is ``ksoftirqd``), and which softirqs the
  ``ksoftirqd`` threads ran there;
* *wake-ups*: for each wake-up of a role thread, the time until it ran, and how
  much of that the CPU spent in softirqs meanwhile;
* *others*: every other task that ran on those CPUs, how often and how long;
* *work items*: the workqueue functions the kernel's workers ran there;
* *events lost*: what the kernel wrote but its buffer no longer held (the
  figures above then undercount).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping

__all__ = ["SchedTrace", "attribute", "merge", "EVENTS"]

TRACEFS = "/sys/kernel/tracing"
EVENTS = ("sched/sched_switch", "sched/sched_wakeup", "irq/softirq_entry", "irq/softirq_exit",
          "workqueue/workqueue_execute_start")
_LINE = re.compile(r"^\s*(?P<comm>.+?)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s.*?(?P<ts>\d+\.\d+): (?P<ev>\w+): (?P<rest>.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")


class SchedTrace:
    """tracefs set to record the events on ``cpus`` between ``start`` and ``stop``."""

    def __init__(self, cpus: Iterable[int], root: str = TRACEFS, buffer_kb: int = 16384) -> None:
        self.cpus, self.root, self.buffer_kb = sorted(cpus), root, buffer_kb

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.root, name), "w") as fh:
            fh.write(value)

    def start(self) -> None:
        if not os.path.exists(os.path.join(self.root, "trace")):
            subprocess.run(["mount", "-t", "tracefs", "tracefs", self.root], check=True)
        self._write("tracing_on", "0")
        self._write("trace", "")
        self._write("tracing_cpumask", format(sum(1 << c for c in self.cpus), "x"))
        self._write("buffer_size_kb", str(self.buffer_kb))
        for ev in EVENTS:
            self._write(f"events/{ev}/enable", "1")
        self._write("tracing_on", "1")

    def stop(self) -> list[str]:
        """Stop, and the trace's lines (the events turned off again, the buffer emptied)."""
        self._write("tracing_on", "0")
        with open(os.path.join(self.root, "trace")) as fh:
            lines = fh.readlines()
        for ev in EVENTS:
            self._write(f"events/{ev}/enable", "0")
        self._write("trace", "")
        return lines


def _who(comm: str) -> str:
    """A kernel thread's name without its CPU (``ksoftirqd/3``, ``kworker/3:1H``, ``migration/3``)."""
    return comm.split("/", 1)[0] if "/" in comm else comm


def attribute(lines: Iterable[str], roles: Mapping[int, str]) -> dict:
    """The figures of a text trace (see the module's text); ``roles``: tid -> role."""
    preempted: Counter = Counter()
    ksoftirqd: Counter = Counter()
    others_n: Counter = Counter()
    others_s: Counter = Counter()
    work: Counter = Counter()
    wakes = {r: [0, 0.0, 0.0] for r in set(roles.values())}  # role -> [wake-ups, wait s, of it in softirqs s]
    woken: dict[int, tuple[float, int, float]] = {}  # tid -> (woken at, cpu, softirq s since)
    running: dict[int, tuple[str, int, float]] = {}  # cpu -> (comm, pid, since)
    in_softirq: dict[int, float] = {}  # cpu -> softirq entered at
    kept = written = 0
    for line in lines:
        if line.startswith("# entries-in-buffer/entries-written:"):  # fewer kept: the buffer overflowed
            counts = line.split(":", 1)[1].split()[0].split("/")
            kept, written = kept + int(counts[0]), written + int(counts[1])
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        cpu, ts, ev, rest = int(m["cpu"]), float(m["ts"]), m["ev"], m["rest"]
        if ev == "sched_switch":
            f = dict(_FIELD.findall(rest.replace(" ==> ", " ")))
            prev, nxt = int(f.get("prev_pid", -1)), int(f.get("next_pid", -1))
            if cpu in running:
                comm, pid, since = running[cpu]
                if pid not in roles and pid != 0:
                    others_s[_who(comm)] += ts - since
            if prev in roles and f.get("prev_state", "").startswith("R"):
                preempted[_who(f.get("next_comm", "?"))] += 1
            if nxt in roles and nxt in woken:
                t0, _, soft = woken.pop(nxt)
                w = wakes[roles[nxt]]
                w[0], w[1], w[2] = w[0] + 1, w[1] + ts - t0, w[2] + soft
            elif nxt not in roles and nxt != 0:
                others_n[_who(f.get("next_comm", "?"))] += 1
            running[cpu] = (f.get("next_comm", "?"), nxt, ts)
        elif ev == "sched_wakeup":
            f = dict(_FIELD.findall(rest))
            tid = int(f.get("pid", -1))
            if tid in roles:
                woken[tid] = (ts, int(f.get("target_cpu", -1)), 0.0)
        elif ev == "softirq_entry":
            in_softirq[cpu] = ts
            if m["comm"].startswith("ksoftirqd/"):
                vec = rest.split("action=")[-1].rstrip("]").strip()
                ksoftirqd[vec] += 1
        elif ev == "softirq_exit" and cpu in in_softirq:
            t0 = in_softirq.pop(cpu)
            for tid, (tw, target, soft) in list(woken.items()):
                if target == cpu:
                    woken[tid] = (tw, target, soft + ts - max(t0, tw))
        elif ev == "workqueue_execute_start":
            work[rest.rsplit("function ", 1)[-1].strip()] += 1
    return {"preempted_by": dict(preempted.most_common()),
            "ksoftirqd_ran": dict(ksoftirqd.most_common()),
            "wakeups": {r: {"count": n, "wait_s": round(s, 6), "in_softirq_s": round(sq, 6)}
                        for r, (n, s, sq) in sorted(wakes.items())},
            "others": {k: {"switched_in": others_n[k], "ran_s": round(others_s[k], 6)}
                       for k in sorted(set(others_n) | set(others_s), key=lambda k: -others_n[k])},
            "work_items": dict(work.most_common()),
            "events_lost": written - kept}


def merge(a: dict | None, b: dict) -> dict:
    """Two rounds' ``attribute`` figures added up."""
    if not a:
        return b

    def add(x: dict, y: dict) -> dict:
        out = dict(x)
        for k, v in y.items():
            out[k] = add(out.get(k, {}), v) if isinstance(v, dict) else round(out.get(k, 0) + v, 6)
        return out

    return add(a, b)
