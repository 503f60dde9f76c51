"""What binding buys: a stand-in worker under a noisy neighbour, unbound vs bound.

    .venv/bin/python bench/effect.py [--seconds 30] [--rounds 3] [--helpers 4]
        [--neighbour auto|stress-ng|spin|none] [--neighbour-procs N] [--json PATH]

The stand-in (bench/stand_in.py) has the real worker's shape: a main thread
handing small steps to an ``acl_thread`` over a pipe and waiting for each, a
``release_thread`` poked every few steps, and helper threads waking every
millisecond. While a neighbour keeps every CPU busy (``stress-ng --cpu N``, or
N spinning processes of our own when stress-ng is absent), it runs three ways,
alternated round by round so drift in the host's load hits all three alike:

* ``unbound``  as started: every thread may run on every allowed CPU;
* ``daemon``   bound by ascendbind through the daemon: POST /v1/bind with the
               worker's pid, a real ``ascendbind serve`` on the fixture one-NPU
               host (``small_pool = share``: on 2 CPUs, main on CPU 0 and
               acl/release on CPU 1);
* ``pool``     every thread on the NPU's whole pool, no role split. No config
               key turns the role split off, so this arm sets each thread's mask
               to the daemon's planned pool itself with sched_setaffinity.

Per role thread: CPU migrations (``se.nr_migrations`` in
/proc/<pid>/task/<tid>/sched) and involuntary context switches
(``nonvoluntary_ctxt_switches``) per second; per arm: step latency p50 / p99 /
p99.9 and steps per second; then the ratios of each bound arm to unbound.

On the fixture host the NPU's pool is every online CPU, so ``pool`` equals
``unbound`` there; ``--host-npu-smi`` uses the host's own npu-smi instead, where
a pool is the NPU's NUMA-local CPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ascendbind.cpulist import format_cpulist  # noqa: E402
from bench.common import write_json  # noqa: E402
from bench.neighbour import Neighbour  # noqa: E402
from tests.daemon_harness import DaemonProc, base_env, free_port  # noqa: E402
from tests.workers import cpus_allowed_of, reap  # noqa: E402

ARMS = ("unbound", "daemon", "pool")
ROLES = ("main", "acl", "release", "helpers")
ROLE_THREADS = ("main", "acl", "release")  # the threads the role split places
GOAL_MIGRATION_CUT = 0.90

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


def thread_counters(pid: int, tid: int) -> tuple[int, int]:
    """(se.nr_migrations, nonvoluntary_ctxt_switches) of one thread."""
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
    return migrations, nonvol


class StandInProc:
    """One bench/stand_in.py child, driven over its stdin/stdout; always reaped."""

    def __init__(self, helpers: int, work: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "stand_in.py"), "--helpers", str(helpers), "--work", str(work)],
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

    def counters(self) -> dict[str, tuple[int, int]]:
        out = {}
        for role, tids in self.tids.items():
            m = n = 0
            for tid in tids:
                a, b = thread_counters(self.pid, tid)
                m, n = m + a, n + b
            out[role] = (m, n)
        return out

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


def run_arm(arm: str, args, daemon: DaemonProc, pool: frozenset[int], tmp: str, tag: str, acc: dict) -> None:
    w = StandInProc(args.helpers, args.work)
    try:
        if arm == "daemon":
            t0 = time.perf_counter()
            answer = daemon.client.bind(pid=w.pid, npu=args.npu)
            acc["bind_ms"].append((time.perf_counter() - t0) * 1e3)
            want = answer["plan"]["npus"][str(args.npu)]
            got = cpus_allowed_of(w.pid, w.tids["acl"][0])
            if got != frozenset(want["acl"]):
                raise RuntimeError(f"daemon bind left acl_thread on {got}, plan says {want['acl']}")
        elif arm == "pool":
            pin_all(w.pid, pool)
        w.ask(f"warm {args.warm}")  # first wake-ups after a mask change may move a thread once
        acc["masks"] = w.masks()
        before = w.counters()
        path = os.path.join(tmp, f"{tag}.bin")
        _, steps, wall = w.ask(f"run {args.seconds / args.rounds} {path}").split()
        after = w.counters()
        samples = array("q")
        with open(path, "rb") as fh:
            samples.frombytes(fh.read())
        os.unlink(path)
        if len(samples) != int(steps):
            raise RuntimeError(f"stand-in reported {steps} steps, wrote {len(samples)}")
        acc["samples"].extend(samples)
        acc["wall_s"] += int(wall) / 1e9
        for role in ROLES:
            acc["migrations"][role] += after[role][0] - before[role][0]
            acc["nonvoluntary"][role] += after[role][1] - before[role][1]
        if arm == "daemon":
            daemon.client.release(pid=w.pid)
    finally:
        w.close()


def arm_result(arm: str, acc: dict, n_helpers: int) -> dict:
    wall = acc["wall_s"] or float("nan")
    threads = {}
    for role in ROLES:
        count = n_helpers if role == "helpers" else 1
        threads[role] = {
            "threads": count,
            "migrations": acc["migrations"][role],
            "nonvoluntary": acc["nonvoluntary"][role],
            "migrations_per_s": acc["migrations"][role] / wall,
            "nonvoluntary_per_s": acc["nonvoluntary"][role] / wall,
        }
    return {
        "arm": arm,
        "steps": len(acc["samples"]),
        "seconds": wall,
        "steps_per_s": len(acc["samples"]) / wall,
        "latency_us": latency_summary(acc["samples"]),
        "histogram": log_histogram(acc["samples"]),
        "threads": threads,
        "masks": acc.get("masks", {}),
        "bind_ms": acc["bind_ms"],
    }


def ratios(results: dict[str, dict]) -> dict[str, dict]:
    base = results["unbound"]
    out = {}
    for arm in ("daemon", "pool"):
        r = results[arm]
        out[arm] = {
            "steps_per_s": ratio(r["steps_per_s"], base["steps_per_s"]),
            **{k: ratio(r["latency_us"][k], base["latency_us"][k]) for k in ("p50", "p99", "p99.9")},
            **{f"migrations_{role}": ratio(r["threads"][role]["migrations_per_s"],
                                           base["threads"][role]["migrations_per_s"]) for role in ROLES},
            **{f"nonvoluntary_{role}": ratio(r["threads"][role]["nonvoluntary_per_s"],
                                             base["threads"][role]["nonvoluntary_per_s"]) for role in ROLES},
            "migration_cut": migration_cut(r, base),
        }
    return out


def print_table(results: dict, rat: dict, plan_npu: dict, args) -> None:
    hdr = f"{'':<26}" + "".join(f"{a:>12}" for a in ARMS) + f"{'daemon/unb':>12}{'pool/unb':>10}"
    print(hdr)
    print("-" * len(hdr))

    def row(label, get, key, fmt="{:12.1f}"):
        vals = "".join(fmt.format(get(results[a])) for a in ARMS)
        print(f"{label:<26}{vals}{fmt_ratio(rat['daemon'][key]):>12}{fmt_ratio(rat['pool'][key]):>10}")

    row("steps/s", lambda r: r["steps_per_s"], "steps_per_s", "{:12.0f}")
    for k in ("p50", "p99", "p99.9"):
        row(f"step latency {k} (us)", lambda r, k=k: r["latency_us"][k], k)
    names = {"main": "main", "acl": "acl_thread", "release": "release_thread",
             "helpers": f"{args.helpers} helpers"}
    for role in ROLES:
        row(f"migrations/s {names[role]}", lambda r, role=role: r["threads"][role]["migrations_per_s"],
            f"migrations_{role}", "{:12.2f}")
    for role in ROLES:
        row(f"invol. csw/s {names[role]}", lambda r, role=role: r["threads"][role]["nonvoluntary_per_s"],
            f"nonvoluntary_{role}", "{:12.2f}")
    print("masks: " + "; ".join(f"{a}: " + ", ".join(f"{k} {v}" for k, v in results[a]["masks"].items())
                                for a in ARMS))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30, help="measured seconds per arm, split over the rounds")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every arm once, order rotated")
    ap.add_argument("--helpers", type=int, default=4, help="helper threads besides main, acl and release")
    ap.add_argument("--work", type=int, default=100, help="arithmetic iterations per step (a few us)")
    ap.add_argument("--warm", type=int, default=500, help="steps run and discarded before each measurement")
    ap.add_argument("--neighbour", choices=("auto", "stress-ng", "spin", "none"), default="auto")
    ap.add_argument("--neighbour-procs", type=int, default=None, help="burner processes (default: one per CPU)")
    ap.add_argument("--npu", type=int, default=0)
    ap.add_argument("--host-npu-smi", action="store_true",
                    help="let the daemon use the npu-smi on PATH, not the fixture one-NPU host")
    ap.add_argument("--json", help="also write the results as JSON to this path ('-': stdout)")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or args.helpers < 0 or args.work < 0:
        ap.error("need --seconds > 0, --rounds >= 1, --helpers >= 0, --work >= 0")
    n_cpus = len(os.sched_getaffinity(0))
    procs = n_cpus if args.neighbour_procs is None else args.neighbour_procs
    # generous: worker start-up and binding take seconds per arm on a loaded host
    neighbour = Neighbour(args.neighbour, procs, budget_s=3 * args.seconds + 90 * args.rounds + 120)
    if neighbour.note:
        print(f"note: {neighbour.note}")

    accs = {a: {"samples": array("q"), "wall_s": 0.0, "bind_ms": [], "migrations": dict.fromkeys(ROLES, 0),
                "nonvoluntary": dict.fromkeys(ROLES, 0)} for a in ARMS}
    with tempfile.TemporaryDirectory(prefix="ascendbind-effect-") as tmp:
        extra = {"ASCENDBIND_RECONCILE_SECONDS": "5"}
        if args.host_npu_smi:
            extra["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        env = base_env(f"{tmp}/s.sock", f"{tmp}/state", free_port(), **extra)
        daemon = DaemonProc(tmp, env).start()
        try:
            daemon.wait_discovered()
            planned = daemon.client.plan(npu=args.npu)["plan"]
            if planned.get("errors") or str(args.npu) not in planned.get("npus", {}):
                print(f"no plan for NPU {args.npu}: {planned.get('errors')}", file=sys.stderr)
                return 3
            plan_npu = planned["npus"][str(args.npu)]
            pool = frozenset(plan_npu["pool"])
            neighbour.start()
            for i in range(args.rounds):
                order = ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]
                for arm in order:
                    neighbour.check()
                    run_arm(arm, args, daemon, pool, tmp, f"{arm}-{i}", accs[arm])
            neighbour.check()
        finally:
            neighbour.stop()
            daemon.stop()

    results = {a: arm_result(a, accs[a], args.helpers) for a in ARMS}
    rat = ratios(results)
    print(f"stand-in worker: main + acl_thread + release_thread + {args.helpers} helpers, "
          f"{args.work}-iteration steps; {n_cpus} CPUs")
    print(f"neighbour: {neighbour.describe()}; arms alternated over {args.rounds} rounds, "
          f"{args.seconds:g} s measured per arm")
    print(f"plan for NPU {args.npu}: pool {format_cpulist(plan_npu['pool'])}, main {format_cpulist(plan_npu['main'])}, "
          f"acl {format_cpulist(plan_npu['acl'])}, release {format_cpulist(plan_npu['release'])}"
          + ("  (the pool is every allowed CPU: pool-only equals unbound here)"
             if pool == frozenset(os.sched_getaffinity(0)) else ""))
    print_table(results, rat, plan_npu, args)
    binds = sorted(results["daemon"]["bind_ms"])
    if binds:
        print(f"daemon bind round trip (POST /v1/bind, under the neighbour): median {percentile(binds, 50):.1f} ms "
              f"over {len(binds)} binds")
    cut = rat["daemon"]["migration_cut"]
    if cut is None:
        print("role-thread migrations: unbound threads did not migrate at all; no cut to report")
    else:
        verdict = "met" if cut >= GOAL_MIGRATION_CUT else "MISSED"
        print(f"role threads (main, acl_thread, release_thread) bound by the daemon migrate {100 * cut:.1f} % less "
              f"than unbound (goal >= {100 * GOAL_MIGRATION_CUT:.0f} %: {verdict})")
    print(f"p99 step latency bound / unbound = {fmt_ratio(rat['daemon']['p99'])} "
          f"(pool only / unbound = {fmt_ratio(rat['pool']['p99'])}); below 1 is faster")
    write_json(args.json, {
        "bench": "effect",
        "params": {"seconds": args.seconds, "rounds": args.rounds, "helpers": args.helpers, "work": args.work,
                   "neighbour": neighbour.describe(), "neighbour_note": neighbour.note, "npu": args.npu,
                   "fixture_host": not args.host_npu_smi},
        "plan": plan_npu,
        "arms": results,
        "ratios": rat,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
