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


