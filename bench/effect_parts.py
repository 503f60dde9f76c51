"""The effect benches' parts: the figures (pure) and the stand-in worker driven from here.

bench/effect.py runs the arms; these are what it measures with. Per thread it
reads three kernel counters: CPU migrations (``se.nr_migrations`` in
/proc/<pid>/task/<tid>/sched), involuntary context switches
(``nonvoluntary_ctxt_switches`` in its status) and the time it waited on a run
queue, runnable but not running (the second field of its ``schedstat``, in ns).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ascendbind.values.cpulist import format_cpulist  # noqa: E402
from tests.workers import cpus_allowed_of, reap  # noqa: E402

ROLES = ("main", "acl", "release", "helpers")
ROLE_THREADS = ("main", "acl", "release")  # the threads the role split places

# ---------------------------------------------------------------- figures (pure)


def percentile(sorted_values, q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (q in 0..100)."""
    n = len(sorted_values)
    if not n:
        return float("nan")
    rank = math.ceil(round(q * n / 100, 9))  # round: 99.9 * 1000 / 100 is 999.0000000000001 in floats
    return float(sorted_values[min(n - 1, max(0, rank - 1))])


def log_histogram(values_ns, lo_ns: float = 1e3, hi_ns: float = 1e9, per_decade: int = 20) -> dict:
    """Counts over log-spaced bins from ``lo_ns`` to ``hi_ns`` (values outside go to the end bins)."""
    decades = math.log10(hi_ns / lo_ns)
    n_bins = int(round(decades * per_decade))
    counts = [0] * n_bins
    scale = per_decade / math.log(10)
    log_lo = math.log(lo_ns)
    for v in values_ns:
        i = int((math.log(max(v, 1)) - log_lo) * scale)
        counts[min(n_bins - 1, max(0, i))] += 1
    edges = [lo_ns / 1e3 * 10 ** (i / per_decade) for i in range(n_bins + 1)]
    return {"edges_us": [round(e, 4) for e in edges], "counts": counts}


def latency_summary(values_ns) -> dict:
    s = sorted(values_ns)
    return {
        "p50": percentile(s, 50) / 1e3,
        "p99": percentile(s, 99) / 1e3,
        "p99.9": percentile(s, 99.9) / 1e3,
        "max": (s[-1] / 1e3) if s else float("nan"),
        "mean": (sum(s) / len(s) / 1e3) if s else float("nan"),
    }


def ratio(a: float, b: float) -> float | None:
    """a / b, or None when b is zero (a ratio to nothing is not a figure)."""
    if b == 0 or b != b or a != a:
        return None
    return a / b


def migration_cut(bound: dict, unbound: dict, roles=ROLE_THREADS) -> float | None:
    """1 - (bound role-thread migrations/s) / (unbound role-thread migrations/s)."""
    b = sum(bound["threads"][r]["migrations_per_s"] for r in roles)
    u = sum(unbound["threads"][r]["migrations_per_s"] for r in roles)
    r = ratio(b, u)
    return None if r is None else 1 - r


def fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


# ---------------------------------------------------------------- the host side


def thread_counters(pid: int, tid: int) -> tuple[int, int, int]:
    """(se.nr_migrations, nonvoluntary_ctxt_switches, run-queue wait in ns) of one thread."""
    migrations = nonvol = 0
    with open(f"/proc/{pid}/task/{tid}/sched") as fh:
        for line in fh:
            if line.startswith("se.nr_migrations"):
                migrations = int(line.split(":", 1)[1])
                break
    with open(f"/proc/{pid}/task/{tid}/status") as fh:
        for line in fh:
            if line.startswith("nonvoluntary_ctxt_switches:"):
                nonvol = int(line.split(":", 1)[1])
    with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:  # on-CPU ns, run-queue wait ns, timeslices
        waited = int(fh.read().split()[1])
    return migrations, nonvol, waited


class StandInProc:
    """One bench/stand_in.py child, driven over its stdin/stdout; always reaped."""

    def __init__(self, helpers: int, work: int, release_every: int = 8) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "stand_in.py"), "--helpers", str(helpers), "--work", str(work),
             "--release-every", str(release_every)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.close()
            raise RuntimeError(f"stand-in worker did not start: {line!r}")
        ids = json.loads(line[6:])
        self.pid = ids["pid"]
        self.tids: dict[str, list[int]] = {"main": [ids["main"]], "acl": [ids["acl"]],
                                           "release": [ids["release"]], "helpers": ids.get("helpers", [])}

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        if not reply or reply == "?":
            raise RuntimeError(f"stand-in {self.pid} did not answer {line!r}")
        return reply

    def counters(self) -> dict[str, tuple[int, int, int]]:
        """Per role, the sums of its threads' ``thread_counters``."""
        return {role: tuple(map(sum, zip((0, 0, 0), *(thread_counters(self.pid, t) for t in tids))))
                for role, tids in self.tids.items()}

    def masks(self) -> dict[str, str]:
        return {role: " ".join(sorted({format_cpulist(cpus_allowed_of(self.pid, t) or ()) for t in tids}))
                for role, tids in self.tids.items() if tids}

    def close(self) -> None:
        reap(self.proc)


def pin_all(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (the pool-only arm), read back."""
    for name in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(name), cpus)
        if os.sched_getaffinity(int(name)) != cpus:
            raise RuntimeError(f"thread {name} of {pid} kept {os.sched_getaffinity(int(name))}, not {cpus}")


# ---------------------------------------------------------------- the emulator's side

MARK = "@@effect-arm"  # the in-guest bench's line before and after each measured run


class VcpuDelay:
    """What the host running the guest's emulator shows of each vCPU while an arm runs.

    Under software emulation every vCPU is a thread of QEMU on this host (named ``CPU
    N/TCG`` with ``-name debug-threads=on``); its run-queue wait here is time the guest
    cannot see as lost: a task the guest woke on that vCPU waits meanwhile, and the
    guest books it as that task's run delay. The in-guest bench prints ``MARK <tag>
    start|end`` around each measured run; each line as it arrives (``on_line``) reads
    every vCPU thread's schedstat, and the waits between a start and its end add up per
    arm (the tag's part before ``-<round>``). ``favour``: vCPUs whose threads run at a
    higher priority here (``nice``) from the first mark on, in every arm alike: an
    experiment that lends those vCPUs something like cores of their own."""

    def __init__(self, favour: frozenset[int] = frozenset(), nice: int = -10) -> None:
        self.favour, self.nice = favour, nice  # vCPUs whose threads get ``nice`` here, once found
        self.qemu: int | None = None
        self.threads: dict[int, int] = {}  # vCPU -> thread id
        self.open: dict[str, tuple[float, dict[int, int]]] = {}
        self.arms: dict[str, dict] = {}

    def on_line(self, proc: subprocess.Popen, line: str) -> None:
        words = line.split()
        if len(words) != 3 or words[0] != MARK or words[2] not in ("start", "end"):
            return
        if not self.threads:
            self._find(proc.pid)
            for cpu in self.favour & set(self.threads):
                os.setpriority(os.PRIO_PROCESS, self.threads[cpu], self.nice)
        now, waits = time.monotonic(), self._waits()
        tag = words[1]
        if words[2] == "start":
            self.open[tag] = (now, waits)
            return
        if tag not in self.open:
            return
        t0, before = self.open.pop(tag)
        arm = self.arms.setdefault(tag.rsplit("-", 1)[0], {"wall_s": 0.0, "wait_ns": {}})
        arm["wall_s"] += now - t0
        for cpu, ns in waits.items():
            if cpu in before:
                arm["wait_ns"][cpu] = arm["wait_ns"].get(cpu, 0) + ns - before[cpu]

    def result(self) -> dict[str, dict]:
        """arm -> {"wall_s", "run_delay_ms_per_s": {vCPU: ms of wait a second}}."""
        return {arm: {"wall_s": round(a["wall_s"], 3),
                      "run_delay_ms_per_s": {str(c): round(ns / 1e6 / a["wall_s"], 3)
                                             for c, ns in sorted(a["wait_ns"].items())}}
                for arm, a in self.arms.items() if a["wall_s"] > 0}

    def _find(self, session: int) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.getsid(int(name)) != session:
                    continue
                with open(f"/proc/{name}/comm") as fh:
                    if not fh.read().startswith("qemu-system"):
                        continue
                for tid in os.listdir(f"/proc/{name}/task"):
                    with open(f"/proc/{name}/task/{tid}/comm") as fh:
                        comm = fh.read().strip()
                    if comm.startswith("CPU ") and comm.endswith("/TCG"):
                        self.threads[int(comm[4:-4])] = int(tid)
                self.qemu = int(name)
                return
            except (OSError, ValueError):
                continue

    def _waits(self) -> dict[int, int]:
        out = {}
        for cpu, tid in self.threads.items():
            try:
                with open(f"/proc/{self.qemu}/task/{tid}/schedstat") as fh:
                    out[cpu] = int(fh.read().split()[1])
            except (OSError, ValueError, IndexError):
                pass
        return out
