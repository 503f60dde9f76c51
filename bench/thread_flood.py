"""One bound worker floods the daemon with thread events; how soon another worker's late ACL
threads are pinned, and what the daemon's CPU costs, at rest and under the flood, side by side.

    .venv/bin/python bench/thread_flood.py [--seconds 10] [--renames 40] [--creators 4] [--python]
                                           [--reconcile 5] [--before DIR] [--json PATH]

Starts ``ascendbind serve`` on the fixture one-NPU host (reconcile every
``--reconcile`` seconds, 5 by default: the shipped period) and binds two real
workers: a *flooder* (tests/hostile_workers.py: ``--creators`` threads each
start a thread that names itself ``acl_thread_<n>``, a rename into the ACL role,
and ends, in a tight loop; three process events per thread; in C, compiled with
``cc``, unless ``--python`` or no compiler) and a quiet worker (tests/workers.py).
Two phases of ``--seconds`` each, first at rest (the flooder bound, idle), then
under the flood:

* pin latency: ``--renames`` times, spread over the phase, the quiet worker
  renames one of its threads to ``acl_thread`` (writing its own
  ``/proc/self/task/<tid>/comm``) and the time from just before the command to
  the first read of that thread's ``sched_getaffinity`` equal to the ACL CPUs
  (polled every 0.5 ms) is taken; the thread is renamed back and waited for on
  the main CPUs (not timed). p50, p90 and max.
* the daemon's CPU: utime + stime of ``/proc/<daemon>/stat`` over the phase,
  as a share of one CPU.
* the churn reached: threads the flooder started per second over the phase.
* the loop's mode: whether the whole loop fell back to listing
  (``ascendbind_reconcile_mode{mode="listing",reason="overflow"}``, and how
  many times the log says so), events lost, workers put over budget.

``--before DIR`` runs the same with the daemon from the checkout DIR (its
ascendbind package) after this one. Goals under the flood (90,000 threads a
second on the attack's host): pin latency p50 <= 50 ms, daemon CPU <= 10 % of
a CPU, no fallback of the whole loop to listing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, seconds_until_mask, write_json  # noqa: E402
from tests.daemon_harness import DaemonProc, base_env, free_port, metric_value, wait_for  # noqa: E402
from tests.hostile_workers import thread_flood_worker  # noqa: E402
from tests.workers import start_worker  # noqa: E402

GOAL_P50_MS = 50.0
GOAL_CPU = 0.10
POLL = 0.0005
TICK = os.sysconf("SC_CLK_TCK")


def _until(tid: int, cpus: frozenset[int], timeout: float) -> float | None:
    return seconds_until_mask(tid, cpus, timeout, POLL)


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (every thread), in seconds."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def quantiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {"n": len(s), "p50_ms": q(0.5) * 1e3, "p90_ms": q(0.9) * 1e3, "max_ms": s[-1] * 1e3,
            "mean_ms": statistics.fmean(s) * 1e3}


def counters(d: DaemonProc) -> dict[str, float]:
    text = d.metrics_text()
    return {
        "losses": metric_value(text, "ascendbind_thread_event_losses_total") or 0,
        "overflows": metric_value(text, "ascendbind_thread_event_overflows_total") or 0,
        "listing_overflow": metric_value(text, "ascendbind_reconcile_mode", mode="listing", reason="overflow") or 0,
        "woken": metric_value(text, "ascendbind_reconcile_woken_runs_total") or 0,
    }


def phase(d: DaemonProc, w, flooder, tid: int, main: frozenset[int], acl: frozenset[int], *, flood: bool,
          seconds: float, renames: int, limit: float) -> dict:
    """One phase: renames spread over ``seconds``, the daemon's CPU and the churn over it."""
    if flood:
        flooder.flood(True)
        time.sleep(1.0)  # past the first reads, the cut and the first re-admission probe
    before, listed0 = counters(d), d.log().count("learns of thread changes by listing")
    c0, s0, t0 = cpu_seconds(d.pid), flooder.started(), time.monotonic()
    lat: list[float] = []
    for i in range(renames):
        due = t0 + (i + 1) * seconds / (renames + 1)
        if time.monotonic() < due:
            time.sleep(due - time.monotonic())
        if _until(tid, main, limit) is None:
            raise SystemExit(f"thread {tid} did not go back to the main CPUs within {limit:g} s (flood {flood}, "
                             f"rename {i}):\n{d.log()[-3000:]}")
        start = time.monotonic()
        w.rename(tid, "acl_thread")
        dt = _until(tid, acl, limit)
        lat.append(limit if dt is None else time.monotonic() - start)
        w.rename(tid, "worker_late")
    if time.monotonic() < t0 + seconds:
        time.sleep(t0 + seconds - time.monotonic())
    c1, s1, t1 = cpu_seconds(d.pid), flooder.started(), time.monotonic()
    after = counters(d)
    mode = d.client.health().get("reconcile")
    state = next((x.get("thread_events") for x in d.client.workers()["workers"] if x["pid"] == flooder.pid), None)
    if flood:
        flooder.flood(False)
    return {"flood": flood, "seconds": t1 - t0, "daemon_cpu": (c1 - c0) / (t1 - t0),
            "threads_per_second": (s1 - s0) / (t1 - t0), "pin": quantiles(lat),
            "missed": sum(1 for x in lat if x >= limit), "mode_at_end": mode, "flooder": state,
            "listing_entered": d.log().count("learns of thread changes by listing") - listed0,
            **{k: after[k] - before[k] for k in ("losses", "overflows", "woken")},
            "listing_overflow_at_end": after["listing_overflow"]}


def measure(label: str, root: str | None, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = base_env(f"{tmp}/s.sock", f"{tmp}/state", free_port(), ASCENDBIND_RECONCILE_SECONDS=str(args.reconcile),
                       ASCENDBIND_ALLOW_SHARED_NPU="true")
        argv = None
        if root is not None:
            argv = [sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); from ascendbind.cli import main; "
                    "sys.exit(main(['serve']))"]
        d = DaemonProc(tmp, env, argv).start()
        try:
            d.wait_discovered()
            with start_worker(plain=1, acl=0, release=0) as w, \
                    thread_flood_worker(args.creators, native=not args.python) as flooder:
                plan = d.client.bind(w.pid, 0)["plan"]["npus"]["0"]
                d.client.bind(flooder.pid, 0)
                main, acl = frozenset(plan["main"]), frozenset(plan["acl"])
                if main == acl:
                    raise SystemExit("the ACL and main CPUs coincide here: a pin cannot be seen (need 2+ CPUs)")
                assert wait_for(lambda: d.client.health().get("reconcile", {}).get("mode") == "events", 10), \
                    d.client.health()
                tid = w.spawn("worker_late")
                limit = 3 * args.reconcile + 5
                rows = [phase(d, w, flooder, tid, main, acl, flood=flood, seconds=args.seconds,
                              renames=args.renames, limit=limit) for flood in (False, True)]
        finally:
            d.stop()
    return {"variant": label, "rest": rows[0], "flood": rows[1]}


def _print(r: dict, native: bool) -> None:
    rest, flood = r["rest"], r["flood"]
    p_r, p_f = rest["pin"], flood["pin"]
    print(f"{r['variant']}: flooder {'C' if native else 'Python'}, {flood['threads_per_second']:,.0f} threads/s "
          f"started ({3 * flood['threads_per_second']:,.0f} events/s)")
    print(f"    pin latency p50 {p_r['p50_ms']:.1f} -> {p_f['p50_ms']:.1f} ms "
          f"(x{p_f['p50_ms'] / max(p_r['p50_ms'], 1e-3):.1f}), p90 {p_r['p90_ms']:.1f} -> {p_f['p90_ms']:.1f}, "
          f"max {p_r['max_ms']:.1f} -> {p_f['max_ms']:.1f}; missed {flood['missed']} "
          f"(goal p50 <= {GOAL_P50_MS:g} ms: {'met' if p_f['p50_ms'] <= GOAL_P50_MS else 'MISSED'})")
    print(f"    daemon CPU {100 * rest['daemon_cpu']:.2f} % -> {100 * flood['daemon_cpu']:.2f} % of a CPU "
          f"(goal <= {100 * GOAL_CPU:g} %: {'met' if flood['daemon_cpu'] <= GOAL_CPU else 'MISSED'})")
    print(f"    under the flood: loop {flood['mode_at_end']}, fell back to listing {flood['listing_entered']} times, "
          f"{flood['losses']:g} lossy reads, {flood['overflows']:g} times over budget, "
          f"{flood['woken']:g} woken looks; the flooder: {flood['flooder']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase (default 10)")
    ap.add_argument("--renames", type=int, default=40, help="timed renames per phase (default 40)")
    ap.add_argument("--creators", type=int, default=4, help="the flooder's creating threads (default 4)")
    ap.add_argument("--python", action="store_true", help="a Python flooder even where cc is found")
    ap.add_argument("--reconcile", type=float, default=5.0)
    ap.add_argument("--before", metavar="DIR", help="also run a daemon from the checkout DIR, after this one")
    ap.add_argument("--json", help="also write the results as JSON to this path ('-': stdout)")
    args = ap.parse_args(argv)
    native = not args.python
    if native:
        try:
            with thread_flood_worker(1, native=True):
                pass
        except LookupError as exc:
            print(f"{exc}: the Python flooder is used", file=sys.stderr)
            args.python, native = True, False
    rows = [measure("this", None, args)]
    if args.before:
        rows.append(measure("before", args.before, args))
    for r in rows:
        _print(r, native)
    if len(rows) == 2:
        this, before = rows[0]["flood"], rows[1]["flood"]
        print(f"under the flood, before / this: pin p50 x{before['pin']['p50_ms'] / max(this['pin']['p50_ms'], 1e-3):.1f}, "
              f"max x{before['pin']['max_ms'] / max(this['pin']['max_ms'], 1e-3):.1f}, "
              f"daemon CPU x{before['daemon_cpu'] / max(this['daemon_cpu'], 1e-6):.2f}")
    write_json(args.json, {"bench": "thread_flood", "machine": machine(), "params": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
