"""What binding buys: a stand-in worker under a noisy neighbour, unbound vs bound,
and, on a two-node kernel, bound with the rest of the host fenced off.

    .venv/bin/python bench/effect.py [--seconds 30] [--rounds 3] [--helpers 4]
        [--neighbour auto|stress-ng|spin|none] [--neighbour-procs N] [--guest] [--json PATH]
        [--release-every N] [--trace] [--plots PREFIX] [--from-json PATH]

The stand-in (bench/stand_in.py) has the real worker's shape: a main thread
handing small steps to an ``acl_thread`` over a pipe and waiting for each, a
``release_thread`` poked every few steps, and helper threads waking every
millisecond. While a neighbour keeps every CPU busy (``stress-ng --cpu N``, or
N spinning processes of our own when stress-ng is absent), it runs several ways,
alternated round by round so drift in the host's load hits every arm alike:

* ``unbound``  as started: every thread may run on every allowed CPU;
* ``daemon``   bound by ascendbind through the daemon: POST /v1/bind with the
               worker's pid, a real ``ascendbind serve`` on the fixture one-NPU
               host (``small_pool = share``: on 2 CPUs, main on CPU 0 and
               acl/release on CPU 1), ``isolation = off``;
* ``pool``     every thread on the NPU's whole pool, no role split. No config
               key turns the role split off, so this arm sets each thread's mask
               to the daemon's planned pool itself with sched_setaffinity.

``--guest`` runs the bench in the two-node QEMU guest of tests/numa_guest.py
(8 vCPUs, node 0 = CPUs 0-3, node 1 = CPUs 4-7; two fixture NPUs, one a node)
with the neighbour on all 8 CPUs, and arms ``unbound``, ``daemon`` and:

* ``irqs``     bound as ``daemon``, with ``isolation = irqs`` (every other IRQ
               off the worker's main/ACL/release CPUs);
* ``host``     bound, with ``isolation = host`` (every other task too: the
               neighbour's processes leave those CPUs).

The level changes between arms by rewriting the daemon's config file and
SIGHUP, checked in ``GET /v1/workers`` before the worker is bound.

Per role thread: CPU migrations, involuntary context switches and run-queue
delay (bench/effect_parts.py) per second; per arm: step latency p50 / p99 /
p99.9 and steps per second; then the ratios of each arm to unbound and, in
the guest, of each isolation arm to ``daemon`` (bound alone).

In the guest it also reads, on this host, how long each vCPU's QEMU thread
waited for one of this host's cores while each arm ran (``VcpuDelay``): a task
the guest wakes on a vCPU waits meanwhile, and the guest books it as that
task's run delay. ``--trace`` records the guest kernel's scheduler events on the
worker's CPUs during each bound arm and says what preempted the role threads
and what their wake-ups waited for (bench/effect_trace.py).

On the fixture host the NPU's pool is every online CPU, so ``pool`` equals
``unbound`` there; ``--host-npu-smi`` uses the host's own npu-smi instead, where
a pool is the NPU's NUMA-local CPUs. Software emulation makes every guest figure
slower than a real host's; the ratios between arms of one run are what carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ascendbind.values.cpulist import format_cpulist, parse_cpulist  # noqa: E402
from bench.common import results_from_guest, write_json  # noqa: E402
from bench.effect_parts import (MARK, ROLE_THREADS, ROLES, StandInProc, VcpuDelay, fmt_ratio,  # noqa: E402,F401
                                latency_summary, log_histogram, migration_cut, percentile, pin_all, ratio)
from bench.effect_trace import SchedTrace, attribute, merge  # noqa: E402
from bench.neighbour import Neighbour  # noqa: E402
from tests.daemon_harness import DaemonProc, base_env, free_port, wait_for  # noqa: E402
from tests.workers import cpus_allowed_of  # noqa: E402

ARMS = ("unbound", "daemon", "pool")
GUEST_ARMS = ("unbound", "daemon", "irqs", "host")
LEVELS = {"daemon": "off", "irqs": "irqs", "host": "host"}  # the bound arms and their isolation level
GOAL_MIGRATION_CUT = 0.90
GOAL_HOST_SHARE = 0.10  # the host level's role-thread switches and run delay against bound alone


class Levels:
    """The daemon's isolation level, set through its config file and SIGHUP."""

    def __init__(self, daemon: DaemonProc, path: str) -> None:
        self.daemon, self.path, self.level = daemon, path, "off"

    def set(self, level: str, timeout: float) -> bool:
        """Whether the daemon now runs at ``level`` (False: it refused it and kept the last)."""
        if level == self.level:
            return True
        with open(self.path, "w") as fh:
            fh.write(f'isolation = "{level}"\n')
        said = self.daemon.log().count("SIGHUP: config")  # "config reloaded" or "config not reloaded"
        self.daemon.proc.send_signal(signal.SIGHUP)
        if not wait_for(lambda: self.daemon.log().count("SIGHUP: config") > said, timeout, 0.2):
            raise RuntimeError(f"the daemon did not reload its config for isolation = {level}")
        if self.daemon.client.workers().get("isolation", {}).get("level") != level:
            return False
        self.level = level
        return True


def new_acc() -> dict:
    return {"samples": array("q"), "wall_s": 0.0, "bind_ms": [], **{k: dict.fromkeys(ROLES, 0) for k in COUNTERS},
            # exported run delay ns, exported involuntary switches, the bench's own two, over the bound runs
            "exported": [0, 0, 0, 0]}


COUNTERS = ("migrations", "nonvoluntary", "run_delay_ns")  # the order of StandInProc.counters' figures


def exported(daemon: DaemonProc, pid: int) -> tuple[int, int]:
    """(run delay ns, involuntary switches) the daemon shows for ``pid``, summed over its roles
    (``GET /v1/workers`` reads every thread afresh: the same figures as its metrics)."""
    roles = daemon.client.worker(pid)["contention"]["roles"]
    return (round(sum(r["run_delay_seconds"] for r in roles.values()) * 1e9),
            sum(r["involuntary_switches"] for r in roles.values()))


def run_arm(arm: str, args, daemon: DaemonProc, pool: frozenset[int], tmp: str, tag: str, acc: dict,
            neighbour: Neighbour) -> None:
    """One arm's round. The neighbour is paused while the stand-in starts, is bound and is
    released: only the warm-up and the measured run share the CPUs with it."""
    with neighbour.paused():
        w = StandInProc(args.helpers, args.work, args.release_every)
    try:
        with neighbour.paused():
            _set_up(arm, args, daemon, pool, w, acc)
        _measure(arm, args, daemon, w, tmp, tag, acc)
        if arm in LEVELS:
            with neighbour.paused():
                daemon.client.release(pid=w.pid)
                if "trace_lines" in acc:
                    roles = {t: r for r in ROLE_THREADS for t in w.tids[r]}
                    acc["trace"] = merge(acc.get("trace"), attribute(acc.pop("trace_lines"), roles))
    finally:
        with neighbour.paused():
            w.close()


def _set_up(arm: str, args, daemon: DaemonProc, pool: frozenset[int], w: StandInProc, acc: dict) -> None:
    if arm in LEVELS:
        t0 = time.perf_counter()
        answer = daemon.client.bind(pid=w.pid, npu=args.npu)
        acc["bind_ms"].append((time.perf_counter() - t0) * 1e3)
        want = answer["plan"]["npus"][str(args.npu)]
        got = cpus_allowed_of(w.pid, w.tids["acl"][0])
        if got != frozenset(want["acl"]):
            raise RuntimeError(f"daemon bind left acl_thread on {got}, plan says {want['acl']}")
    elif arm == "pool":
        pin_all(w.pid, pool)


def _measure(arm: str, args, daemon: DaemonProc, w: StandInProc, tmp: str, tag: str, acc: dict) -> None:
    w.ask(f"warm {args.warm}")  # first wake-ups after a mask change may move a thread once
    acc["masks"] = w.masks()
    exported0 = exported(daemon, w.pid) if arm in LEVELS else None
    before = w.counters()
    path = os.path.join(tmp, f"{tag}.bin")
    trace = None
    if args.in_guest and args.trace and arm in LEVELS:  # the scheduler on the CPUs the role threads may use
        trace = SchedTrace(set().union(*(cpus_allowed_of(w.pid, t) for r in ROLE_THREADS for t in w.tids[r])))
        trace.start()
    if args.in_guest:  # for the watcher of the emulator's threads outside (VcpuDelay)
        print(f"{MARK} {tag} start", flush=True)
    _, steps, wall = w.ask(f"run {args.seconds / args.rounds} {path}").split()
    if args.in_guest:
        print(f"{MARK} {tag} end", flush=True)
    if trace is not None:  # read once the neighbour is paused: Python on a saturated vCPU crawls
        acc["trace_lines"] = trace.stop()
    after = w.counters()
    if exported0 is not None:  # what the daemon exports for the same threads over the same run
        exported1 = exported(daemon, w.pid)
        for k in range(2):
            acc["exported"][k] += exported1[k] - exported0[k]
        acc["exported"][2] += sum(after[r][2] - before[r][2] for r in ROLES)
        acc["exported"][3] += sum(after[r][1] - before[r][1] for r in ROLES)
    samples = array("q")
    with open(path, "rb") as fh:
        samples.frombytes(fh.read())
    os.unlink(path)
    if len(samples) != int(steps):
        raise RuntimeError(f"stand-in reported {steps} steps, wrote {len(samples)}")
    acc["samples"].extend(samples)
    acc["wall_s"] += int(wall) / 1e9
    for role in ROLES:
        for k, name in enumerate(COUNTERS):
            acc[name][role] += after[role][k] - before[role][k]


def arm_result(arm: str, acc: dict, n_helpers: int) -> dict:
    wall = acc["wall_s"] or float("nan")
    threads = {}
    for role in ROLES:
        count = n_helpers if role == "helpers" else 1
        delay = acc.get("run_delay_ns", {}).get(role, 0)
        threads[role] = {
            "threads": count,
            "migrations": acc["migrations"][role],
            "nonvoluntary": acc["nonvoluntary"][role],
            "migrations_per_s": acc["migrations"][role] / wall,
            "nonvoluntary_per_s": acc["nonvoluntary"][role] / wall,
            "run_delay_ms_per_s": delay / 1e6 / wall,  # ms a second spent runnable, waiting for a CPU
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
        # the daemon's own figures for the same threads, against the bench's readings (1.0: agree)
        "exported": exported_result(acc.get("exported", (0, 0, 0, 0)), wall),
        "trace": acc.get("trace"),  # with --trace: what preempted the role threads (effect_trace.py)
    }


def exported_result(e, wall: float) -> dict | None:
    """The daemon's figures over the bound runs against the bench's readings; None: unbound arm."""
    if not e[2] and not e[3]:
        return None
    return {"run_delay_ms_per_s": e[0] / 1e6 / wall, "nonvoluntary_per_s": e[1] / wall,
            "run_delay_agreement": e[0] / e[2] if e[2] else float("nan"),
            "nonvoluntary_agreement": e[1] / e[3] if e[3] else float("nan")}


def role_sum(result: dict, key: str) -> float:
    """``key`` summed over the role threads (main, acl_thread, release_thread)."""
    return sum(result["threads"][r].get(key, 0.0) for r in ROLE_THREADS)


def ratios(results: dict[str, dict], base: str = "unbound") -> dict[str, dict]:
    """Each arm but ``base`` against ``base``."""
    ref = results[base]
    out = {}
    for arm, r in results.items():
        if arm == base:
            continue
        out[arm] = {
            "steps_per_s": ratio(r["steps_per_s"], ref["steps_per_s"]),
            **{k: ratio(r["latency_us"][k], ref["latency_us"][k]) for k in ("p50", "p99", "p99.9")},
            **{f"migrations_{role}": ratio(r["threads"][role]["migrations_per_s"],
                                           ref["threads"][role]["migrations_per_s"]) for role in ROLES},
            **{f"nonvoluntary_{role}": ratio(r["threads"][role]["nonvoluntary_per_s"],
                                             ref["threads"][role]["nonvoluntary_per_s"]) for role in ROLES},
            **{f"run_delay_{role}": ratio(r["threads"][role].get("run_delay_ms_per_s", 0.0),
                                          ref["threads"][role].get("run_delay_ms_per_s", 0.0)) for role in ROLES},
            "role_nonvoluntary": ratio(role_sum(r, "nonvoluntary_per_s"), role_sum(ref, "nonvoluntary_per_s")),
            "role_run_delay": ratio(role_sum(r, "run_delay_ms_per_s"), role_sum(ref, "run_delay_ms_per_s")),
            "migration_cut": migration_cut(r, ref),
        }
    return out


def print_table(results: dict, rat: dict, args, base: str = "unbound") -> None:
    arms = list(results)
    others = [a for a in arms if a != base]
    hdr = f"{'':<28}" + "".join(f"{a:>11}" for a in arms) + "".join(f"{a + '/' + base[:3]:>12}" for a in others)
    print(hdr)
    print("-" * len(hdr))

    def row(label, get, key, fmt="{:11.1f}"):
        vals = "".join(fmt.format(get(results[a])) for a in arms)
        print(f"{label:<28}{vals}" + "".join(f"{fmt_ratio(rat[a][key]):>12}" for a in others))

    row("steps/s", lambda r: r["steps_per_s"], "steps_per_s", "{:11.0f}")
    for k in ("p50", "p99", "p99.9"):
        row(f"step latency {k} (us)", lambda r, k=k: r["latency_us"][k], k)
    names = {"main": "main", "acl": "acl_thread", "release": "release_thread",
             "helpers": f"{args.helpers} helpers"}
    for label, key, rkey in (("migrations/s", "migrations_per_s", "migrations"),
                             ("invol. csw/s", "nonvoluntary_per_s", "nonvoluntary"),
                             ("run delay ms/s", "run_delay_ms_per_s", "run_delay")):
        for role in ROLES:
            row(f"{label} {names[role]}", lambda r, role=role, key=key: r["threads"][role][key],
                f"{rkey}_{role}", "{:11.2f}")
    for a in arms:
        e = results[a].get("exported")
        if e:
            print(f"exported by the daemon, {a}: run delay {e['run_delay_ms_per_s']:.2f} ms/s "
                  f"({e['run_delay_agreement']:.3f}x the bench's reading), involuntary switches "
                  f"{e['nonvoluntary_per_s']:.1f}/s ({e['nonvoluntary_agreement']:.3f}x)")
    print("masks: " + "; ".join(f"{a}: " + ", ".join(f"{k} {v}" for k, v in results[a]["masks"].items())
                                for a in arms))


def daemon_env(tmp: str, args) -> dict[str, str]:
    extra = {"ASCENDBIND_RECONCILE_SECONDS": "5"}
    if args.in_guest:
        from tests.numa.conftest import recorded_npu_smi

        # two NPUs, one a node; the replayed tables keep discovery to seconds in the guest
        extra.update(ASCENDBIND_NPU_SMI=recorded_npu_smi(os.path.join(tmp, "npu-smi"), 2, "0-3;4-7"),
                     ASCENDBIND_COMMAND_TIMEOUT_SECONDS="120", ASCENDBIND_CONFIG=os.path.join(tmp, "config.toml"),
                     ASCENDBIND_IRQBALANCE="warn", ASCENDBIND_MEMORY_CHECK_SECONDS="0")
        with open(extra["ASCENDBIND_CONFIG"], "w") as fh:
            fh.write('isolation = "off"\n')
    elif args.host_npu_smi:
        extra["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
    return base_env(f"{tmp}/s.sock", f"{tmp}/state", free_port(), **extra)


def measure(args) -> dict:
    """Every arm, alternated over the rounds: the results, the ratios and the plan."""
    arms = GUEST_ARMS if args.in_guest else ARMS
    n_cpus = len(os.sched_getaffinity(0))
    procs = n_cpus if args.neighbour_procs is None else args.neighbour_procs
    slow = 20 if args.in_guest else 1  # Python starts some 20 to 50 times slower in the guest
    # generous: worker start-up and binding take seconds per arm on a loaded host
    neighbour = Neighbour(args.neighbour, procs, budget_s=3 * args.seconds + slow * (90 * args.rounds + 120))
    if neighbour.note:
        print(f"note: {neighbour.note}")
    accs = {a: new_acc() for a in arms}
    refused: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ascendbind-effect-") as tmp:
        daemon = DaemonProc(tmp, daemon_env(tmp, args)).start(wait=False)
        try:
            daemon.wait_ready(15 * slow)
            daemon.wait_discovered(15 * slow)
            levels = Levels(daemon, daemon.env.get("ASCENDBIND_CONFIG", ""))
            planned = daemon.client.plan(npu=args.npu)["plan"]
            if planned.get("errors") or str(args.npu) not in planned.get("npus", {}):
                raise SystemExit(f"no plan for NPU {args.npu}: {planned.get('errors')}")
            plan_npu = planned["npus"][str(args.npu)]
            pool = frozenset(plan_npu["pool"])
            neighbour.start()
            for i in range(args.rounds):
                for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
                    if arm in refused:
                        continue
                    neighbour.check()
                    if args.in_guest and arm in LEVELS and not levels.set(LEVELS[arm], 15 * slow):
                        refused.append(arm)
                        print(f"note: this daemon refuses isolation = {LEVELS[arm]}; arm {arm} left out")
                        continue
                    run_arm(arm, args, daemon, pool, tmp, f"{arm}-{i}", accs[arm], neighbour)
            neighbour.check()
        finally:
            neighbour.stop()
            daemon.stop(timeout=10 * slow)
    results = {a: arm_result(a, accs[a], args.helpers) for a in arms if a not in refused}
    out = {"bench": "effect", "params": {
        "seconds": args.seconds, "rounds": args.rounds, "helpers": args.helpers, "work": args.work,
        "release_every": args.release_every,
        "neighbour": neighbour.describe(), "neighbour_note": neighbour.note, "npu": args.npu, "cpus": n_cpus,
        "fixture_host": not args.host_npu_smi, "guest": bool(args.in_guest)},
        "plan": plan_npu, "arms": results, "ratios": ratios(results)}
    if args.in_guest:
        out["ratios_to_bound"] = ratios({a: r for a, r in results.items() if a != "unbound"}, base="daemon")
    return out


def report(res: dict, args) -> None:
    p, plan_npu, results, rat = res["params"], res["plan"], res["arms"], res["ratios"]
    print(f"stand-in worker: main + acl_thread + release_thread + {p['helpers']} helpers, "
          f"{p['work']}-iteration steps, release_thread poked "
          + (f"every {p.get('release_every', 8)} steps" if p.get("release_every", 8) else "never")
          + f"; {p['cpus']} CPUs" + (" (two-node guest)" if p.get("guest") else ""))
    print(f"neighbour: {p['neighbour']}; arms alternated over {p['rounds']} rounds, {p['seconds']:g} s measured per arm")
    print(f"plan for NPU {p['npu']}: pool {format_cpulist(plan_npu['pool'])}, main {format_cpulist(plan_npu['main'])}, "
          f"acl {format_cpulist(plan_npu['acl'])}, release {format_cpulist(plan_npu['release'])}")
    print_table(results, rat, args)
    binds = sorted(results["daemon"]["bind_ms"])
    if binds:
        print(f"daemon bind round trip (POST /v1/bind, the neighbour paused): median {percentile(binds, 50):.1f} ms "
              f"over {len(binds)} binds")
    cut = rat["daemon"]["migration_cut"]
    if cut is None:
        print("role-thread migrations: unbound threads did not migrate at all; no cut to report")
    else:
        verdict = "met" if cut >= GOAL_MIGRATION_CUT else "MISSED"
        print(f"role threads (main, acl_thread, release_thread) bound by the daemon migrate {100 * cut:.1f} % less "
              f"than unbound (goal >= {100 * GOAL_MIGRATION_CUT:.0f} %: {verdict})")
    print(f"p99 step latency bound / unbound = {fmt_ratio(rat['daemon']['p99'])}; below 1 is faster")
    emulator_waits(res)
    traced(res)
    for arm, r in res.get("ratios_to_bound", {}).items():
        nv, rd = r["role_nonvoluntary"], r["role_run_delay"]
        line = (f"{arm} / bound alone, role threads: involuntary switches {fmt_ratio(nv)}, run delay {fmt_ratio(rd)}, "
                f"p99 {fmt_ratio(r['p99'])}, p99.9 {fmt_ratio(r['p99.9'])}")
        if arm == "host":
            ok = nv is not None and rd is not None and nv <= GOAL_HOST_SHARE and rd <= GOAL_HOST_SHARE
            line += f" (goal <= {GOAL_HOST_SHARE:.2f}x both: {'met' if ok else 'MISSED'})"
        print(line)


def emulator_waits(res: dict) -> None:
    """Beside the role threads' run delay in the guest, the run-queue wait of the vCPUs
    they run on, on the host running the emulator (VcpuDelay)."""
    plan = res["plan"]
    roles = sorted(set(plan["main"]) | set(plan["acl"]) | set(plan["release"]))
    if res["params"].get("favour_vcpus"):
        print(f"emulator: vCPUs {res['params']['favour_vcpus']} ran at nice -10 on this host in every arm")
    for arm, e in (res.get("emulator") or {}).items():
        if arm not in res["arms"]:
            continue
        waits = {int(c): v for c, v in e["run_delay_ms_per_s"].items()}
        mine = sum(waits.get(c, 0.0) for c in roles)
        rest = [v for c, v in waits.items() if c not in roles]
        guest = role_sum(res["arms"][arm], "run_delay_ms_per_s")
        print(f"emulator, {arm}: vCPUs {format_cpulist(roles)} waited {mine:.1f} ms/s on this host's run queues "
              f"(the other vCPUs {sum(rest) / max(len(rest), 1):.1f} ms/s each); the role threads' run delay "
              f"in the guest {guest:.1f} ms/s")


def traced(res: dict) -> None:
    """With --trace: per bound arm, what preempted the role threads, what their wake-ups
    waited for, and what else ran on their CPUs."""
    for arm, r in res["arms"].items():
        t = r.get("trace")
        if not t:
            continue
        by = ", ".join(f"{k} {v}" for k, v in t["preempted_by"].items()) or "nothing"
        soft = ", ".join(f"{k} {v}" for k, v in t["ksoftirqd_ran"].items()) or "nothing"
        print(f"trace, {arm}: role threads preempted by {by}; ksoftirqd ran {soft}"
              + (f" ({t['events_lost']} events lost: the buffer overflowed)" if t.get("events_lost") else ""))
        n = sum(w["count"] for w in t["wakeups"].values())
        wait = sum(w["wait_s"] for w in t["wakeups"].values())
        soft_s = sum(w["in_softirq_s"] for w in t["wakeups"].values())
        if n:
            print(f"trace, {arm}: {n} wake-ups of role threads, {1e6 * wait / n:.1f} us each from wake-up to "
                  f"running, {100 * soft_s / wait if wait else 0:.1f} % of it in softirqs on that CPU")
        others = sorted(t["others"].items(), key=lambda kv: -kv[1]["ran_s"])[:6]
        print(f"trace, {arm}: others on those CPUs (switched in, ran s): "
              + (", ".join(f"{k} {v['switched_in']} / {v['ran_s']:.3f}" for k, v in others) or "none")
              + "; work items: " + (", ".join(f"{k} {v}" for k, v in list(t["work_items"].items())[:5]) or "none"))


def in_the_guest(args) -> dict | None:
    """Boot the two-node guest and run this bench there; its JSON comes back through the
    guest's writable directory."""
    def argv(out: str) -> list[str]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--in-guest", "--json", os.path.join(out, "effect.json"),
               "--seconds", str(args.seconds), "--rounds", str(args.rounds), "--helpers", str(args.helpers),
               "--work", str(args.work), "--warm", str(args.warm), "--neighbour", args.neighbour,
               "--release-every", str(args.release_every)] + (["--trace"] if args.trace else [])
        if args.neighbour_procs is not None:
            cmd += ["--neighbour-procs", str(args.neighbour_procs)]
        return cmd

    vcpus = VcpuDelay(favour=parse_cpulist(args.favour_vcpus) if args.favour_vcpus else frozenset())
    res = results_from_guest(argv, "effect.json", on_line=vcpus.on_line)
    if res is not None:
        res["emulator"] = vcpus.result()
        res["params"]["favour_vcpus"] = args.favour_vcpus
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30, help="measured seconds per arm, split over the rounds")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every arm once, order rotated")
    ap.add_argument("--helpers", type=int, default=4, help="helper threads besides main, acl and release")
    ap.add_argument("--work", type=int, default=100, help="arithmetic iterations per step (a few us)")
    ap.add_argument("--release-every", type=int, default=8,
                    help="steps between the acl_thread's pokes of release_thread (0: never). Both share a CPU in "
                         "the plan, so each poke may preempt acl_thread: 0 leaves only other tasks' preemptions")
    ap.add_argument("--warm", type=int, default=500, help="steps run and discarded before each measurement")
    ap.add_argument("--neighbour", choices=("auto", "stress-ng", "spin", "none"), default="auto")
    ap.add_argument("--neighbour-procs", type=int, default=None, help="burner processes (default: one per CPU)")
    ap.add_argument("--npu", type=int, default=0)
    ap.add_argument("--host-npu-smi", action="store_true",
                    help="let the daemon use the npu-smi on PATH, not the fixture one-NPU host")
    ap.add_argument("--guest", action="store_true",
                    help="run in the two-node QEMU guest, with the isolation arms (irqs, host)")
    ap.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--favour-vcpus", metavar="CPULIST",
                    help="with --guest: run these vCPUs' QEMU threads at nice -10 on this host in every arm (an "
                         "experiment: the worker's vCPUs get something like cores of their own)")
    ap.add_argument("--trace", action="store_true",
                    help="with --guest: trace the scheduler on the worker's CPUs while each bound arm runs, and say "
                         "what preempted the role threads and what their wake-ups waited for (bench/effect_trace.py)")
    ap.add_argument("--json", help="also write the results as JSON to this path ('-': stdout)")
    ap.add_argument("--plots", metavar="PREFIX",
                    help="also draw the latency and per-thread plots to PREFIX_latency.png, PREFIX_threads.png "
                         "(needs matplotlib: pip install -e '.[bench]')")
    ap.add_argument("--from-json", metavar="PATH", help="report and draw a saved run instead of measuring")
    args = ap.parse_args(argv)
    if args.trace and not (args.guest or args.in_guest):
        ap.error("--trace needs --guest: tracing is host-wide, so it runs in the disposable guest only")
    if args.favour_vcpus and not args.guest:
        ap.error("--favour-vcpus needs --guest")
    if args.favour_vcpus:
        try:
            parse_cpulist(args.favour_vcpus)
        except ValueError as exc:
            ap.error(f"--favour-vcpus: {exc}")
    if args.seconds <= 0 or args.rounds < 1 or args.helpers < 0 or args.work < 0 or args.release_every < 0:
        ap.error("need --seconds > 0, --rounds >= 1, --helpers >= 0, --work >= 0, --release-every >= 0")
    if args.from_json:
        with open(args.from_json) as fh:
            res = json.load(fh)
    elif args.guest:
        res = in_the_guest(args)
        if res is None:
            return 1
    else:
        res = measure(args)
    report(res, args)
    write_json(args.json, res)
    if args.plots:
        from bench import plots

        for made in (plots.plot_effect_latency(res, f"{args.plots}_latency.png"),
                     plots.plot_effect_threads(res, f"{args.plots}_threads.png")):
            print(f"wrote {made}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
