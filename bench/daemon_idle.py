"""What an idle daemon costs: CPU, memory and reconcile pass time with bound workers.

    .venv/bin/python bench/daemon_idle.py [--points 16x200] [--reconcile 5,1] [--seconds 60] [--json PATH]

For each point WxT (W real workers of T named threads each) and each reconcile
period, starts ``ascendbind serve`` on the fixture one-NPU host
(allow_shared_npu, so every worker shares NPU 0), binds the workers through the
socket, lets start-up settle, then measures over the window:

* CPU: the sum of ``/proc/<daemon>/task/*/schedstat`` run time (nanoseconds,
  far below a clock tick) as a share of one CPU. The window starts just after a
  pass ends and holds exactly k = seconds / period passes; its CPU time is
  charged to k periods (k x period seconds), so the figure is what each
  period costs, rounded up by the half period of sleep at the window's end.
  The memory locality check runs once every ``memory_check_seconds`` (300 s),
  longer than the window: its thread's CPU is taken out of the window and its
  cost added amortized instead, the CPU its rounds took so far (the first one
  runs right after the binds) divided by the rounds and by
  ``memory_check_seconds``;
* where it goes: the same per thread name (the daemon names its threads:
  reconcile, memory-locality, api, hotplug, ...), and the whole process from
  its own utime + stime ticks as a cross-check: coarse (10 ms), but it keeps
  the time of threads that ended inside the window, which a per-thread sum
  cannot see;
* memory: VmRSS, and the daemon's thread count;
* reconcile: passes in the window and their mean wall time, from the daemon's
  own ``ascendbind_reconcile_duration_seconds`` histogram (sum and count), and
  that time divided by the threads one pass walks (W x T): the pass cost per
  thread. On a busy host a pass's wall time includes time spent preempted, so
  the pass's own CPU time is given too, from ``ascendbind_reconcile_cpu_seconds``
  (the reconcile thread's ``thread_time``; absent from daemons older than it),
  and the whole daemon's CPU time per pass (and per thread): an upper bound,
  since it also holds whatever else the daemon did in the window.

Goals at 16 x 200 with the default period (5 s): CPU < 0.2 % of one CPU, RSS < 60 MB.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ascendbind.values.config import Config  # noqa: E402
from bench.common import write_json  # noqa: E402
from tests.daemon_harness import DaemonProc, base_env, free_port, metric_value, wait_for  # noqa: E402
from tests.workers import start_worker  # noqa: E402

GOAL_CPU_PERCENT = 0.2
GOAL_RSS_MB = 60.0
GOAL_POINT = (16, 200, 5.0)
HIST = "ascendbind_reconcile_duration_seconds"
LOCALITY_THREAD = "memory-locality"
CPU_HIST = "ascendbind_reconcile_cpu_seconds"


def run_ns(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (comm, CPU time in ns: schedstat's first field) for every live thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                ns = int(fh.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                comm = fh.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended in between
        out[int(tid)] = (comm, ns)
    return out


def cpu_by_thread(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, int]:
    """Thread name -> CPU ns spent between two run_ns readings (the daemon names its threads:
    reconcile, api, api-worker_0, hotplug, ...; the main thread carries the process name). A
    thread born in between counts from zero; one that ended in between (a /metrics handler
    finishing its reply) loses only its last moments, which a plain sum over live threads would
    instead subtract."""
    out: dict[str, int] = {}
    for tid, (comm, ns) in after.items():
        out[comm] = out.get(comm, 0) + ns - before.get(tid, (comm, 0))[1]
    return out


def cpu_between(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> int:
    """CPU ns spent between two run_ns readings, all threads together."""
    return sum(cpu_by_thread(before, after).values())


def process_ticks(pid: int) -> int:
    """utime + stime of the whole process (clock ticks): unlike the per-thread readings,
    it keeps the time of threads that ended inside the window."""
    with open(f"/proc/{pid}/stat") as fh:
        rest = fh.read().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])


def check_period(root: str | None) -> float:
    """``memory_check_seconds`` by default in this checkout (None) or the one at ``root``."""
    if root is None:
        return Config().memory_check_seconds
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); "
                          "from ascendbind.values.config import Config; print(Config().memory_check_seconds)"],
                         capture_output=True, text=True, check=True, timeout=60)
    return float(out.stdout)


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of ``name`` (all label values); None when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]
    return sum(values) if values else None


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split(":", 1)[1].split()[0])
    return -1


def wait_pass(d: DaemonProc, reconcile: float) -> str:
    """Poll /metrics until one more reconcile pass has ended; returns that metrics text."""
    first = metric_value(d.metrics_text(), f"{HIST}_count") or 0
    seen: list[str] = []

    def passed() -> bool:
        text = d.metrics_text()
        seen.append(text)
        return (metric_value(text, f"{HIST}_count") or 0) > first

    assert wait_for(passed, 3 * reconcile + 30, interval=0.05), "no reconcile pass within three periods"
    return seen[-1]


def parse_points(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        w, _, t = item.strip().lower().partition("x")
        if not w.isdigit() or not t.isdigit() or int(w) < 1 or int(t) < 3:
            raise argparse.ArgumentTypeError(f"point {item!r}: want WORKERSxTHREADS, threads >= 3")
        out.append((int(w), int(t)))
    return out


def _daemon(tmp: str, reconcile: float, variant: tuple[str, str | None, dict[str, str]]) -> DaemonProc:
    """A daemon for one variant: (label, checkout to run it from (None: this one), extra env)."""
    label, root, extra = variant
    os.makedirs(f"{tmp}/{label}")
    env = base_env(f"{tmp}/{label}/s.sock", f"{tmp}/{label}/state", free_port(), ASCENDBIND_ALLOW_SHARED_NPU="true",
                   ASCENDBIND_RECONCILE_SECONDS=str(reconcile), **extra)
    argv = None
    if root is not None:  # another checkout's package first on the path (the cwd would win with -m)
        argv = [sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); from ascendbind.cli import main; "
                "sys.exit(main(['serve']))"]
    return DaemonProc(f"{tmp}/{label}", env, argv)


def measure(reconcile: float, n_workers: int, n_threads: int, seconds: float,
            variants=(("this", None, {}),)) -> list[dict]:
    """One row per variant; all variants' daemons hold the same workers and are measured
    over the same window, side by side."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        daemons = []
        for v in variants:
            d = _daemon(tmp, reconcile, v).start()
            stack.callback(d.stop)
            d.wait_discovered()
            daemons.append(d)
        total_threads = 0
        for _ in range(n_workers):
            # start_worker adds a main thread and a churner to the named ones
            w = stack.enter_context(start_worker(plain=n_threads - 4, acl=1, release=1))
            total_threads += len(os.listdir(f"/proc/{w.pid}/task"))
            for d in daemons:  # the same plan from each: the masks agree, nobody sees drift
                d.client.bind(pid=w.pid, npu=0)
        for d in daemons:
            assert wait_for(lambda: len(d.client.workers()["workers"]) == n_workers, 10), d.log()[-2000:]
        # settle: one full pass after the last bind, then start the window just after the next
        # pass of the first daemon ends, and end it half a period after the k-th pass of the
        # window began, so the window holds k passes of each (whatever the phases)
        for d in daemons:
            wait_pass(d, reconcile)
        texts0 = [d.metrics_text() for d in daemons[1:]]
        texts0.insert(0, wait_pass(daemons[0], reconcile))
        k = max(1, round(seconds / reconcile))
        c0 = [run_ns(d.pid) for d in daemons]
        p0 = [process_ticks(d.pid) for d in daemons]
        t0 = time.monotonic()
        time.sleep((k + 0.5) * reconcile)  # the window itself: an idle daemon is what is measured
        c1 = [run_ns(d.pid) for d in daemons]
        p1 = [process_ticks(d.pid) for d in daemons]
        t1 = time.monotonic()
        load = [round(x, 2) for x in os.getloadavg()]
        rows = []
        for i, (d, (label, _root, _extra)) in enumerate(zip(daemons, variants)):
            text0, text1 = texts0[i], d.metrics_text()
            passes = (metric_value(text1, f"{HIST}_count") or 0) - (metric_value(text0, f"{HIST}_count") or 0)
            pass_s = (metric_value(text1, f"{HIST}_sum") or 0) - (metric_value(text0, f"{HIST}_sum") or 0)
            has_cpu = metric_value(text1, f"{CPU_HIST}_sum") is not None
            pass_cpu_s = (metric_value(text1, f"{CPU_HIST}_sum") or 0) - (metric_value(text0, f"{CPU_HIST}_sum") or 0)
            split = cpu_by_thread(c0[i], c1[i])
            # the locality rounds, amortized over their period (see the module's docstring)
            split.pop(LOCALITY_THREAD, None)
            rounds = round((metric_sum(text1, "ascendbind_memory_checks_total") or 0) / n_workers)
            round_ns = sum(ns for comm, ns in c1[i].values() if comm == LOCALITY_THREAD) / max(rounds, 1)
            check_s = check_period(variants[i][1])
            mean_pass = pass_s / passes if passes else float("nan")
            # charged to `passes` periods, not the longer window: the half period of pure
            # sleep at the end only inflates the figure, never hides a pass
            cycles = max(passes, 1) * reconcile
            # one round every check_s seconds: its share of these `cycles` seconds
            split[LOCALITY_THREAD + " (amortized)"] = int(round_ns * cycles / check_s) if check_s > 0 else 0
            cpu_s = sum(split.values()) / 1e9
            mode = next((m for m in ("events", "listing") if any(
                metric_value(text1, "ascendbind_reconcile_mode", mode=m, reason=r) == 1
                for r in ("", "off", "unsupported", "permission", "namespace", "no_ack", "overflow", "error"))),
                "listing")
            rows.append({
                "variant": label,
                "reconcile_mode": mode,
                "workers": n_workers,
                "threads_per_worker": n_threads,
                "threads_total": total_threads,
                "reconcile_seconds": reconcile,
                "window_s": t1 - t0,
                "cpu_percent": 100 * cpu_s / cycles,
                # the same from the process's own tick counters (10 ms grain), which also hold the
                # time of threads that ended inside the window: a cross-check on the figure above
                "cpu_percent_ticks": 100 * (p1[i] - p0[i]) / os.sysconf("SC_CLK_TCK") / cycles,
                # per thread name, same units: where the idle CPU goes
                "cpu_percent_by_thread": {name: 100 * ns / 1e9 / cycles
                                          for name, ns in sorted(split.items(), key=lambda kv: -kv[1])},
                "locality_round_ms": round_ns / 1e6, "locality_rounds": rounds, "memory_check_seconds": check_s,
                "quiet_passes": (metric_value(text1, "ascendbind_reconcile_quiet_runs_total") or 0)
                - (metric_value(text0, "ascendbind_reconcile_quiet_runs_total") or 0),
                "loadavg": load,
                "rss_mb": status_kb(d.pid, "VmRSS") / 1024,
                "daemon_threads": status_kb(d.pid, "Threads"),
                "passes": passes,
                "pass_ms": mean_pass * 1e3,
                "pass_us_per_thread": mean_pass * 1e6 / total_threads,
                "pass_cpu_us_per_thread": (pass_cpu_s * 1e6 / passes / total_threads
                                           if passes and has_cpu else float("nan")),
                "cpu_ms_per_pass": cpu_s * 1e3 / passes if passes else float("nan"),
                "cpu_us_per_thread": cpu_s * 1e6 / passes / total_threads if passes else float("nan"),
            })
        return rows


def _print_row(r: dict) -> None:
    print(f"{r['variant']:>8} {r['workers']:>7} {r['threads_per_worker']:>5} {r['threads_total']:>7} "
          f"{r['reconcile_seconds']:>6g}  {r['cpu_percent']:>7.3f}  {r['rss_mb']:>6.1f}  {r['daemon_threads']:>3}  "
          f"{r['passes']:>6g}  {r['pass_ms']:>7.2f}  {r['pass_us_per_thread']:>9.2f}  "
          f"{r['pass_cpu_us_per_thread']:>15.2f}  {r['cpu_ms_per_pass']:>11.2f}  {r['cpu_us_per_thread']:>13.2f}",
          flush=True)
    print(f"        {r['reconcile_mode']} mode; per thread (% of one CPU): " + ", ".join(
        f"{name} {pct:.3f}" for name, pct in r["cpu_percent_by_thread"].items() if pct >= 0.0005)
        + f"; whole process from its tick counters {r['cpu_percent_ticks']:.3f} "
        f"(10 ms grain, counts threads that ended too, no amortizing); load average {r['loadavg'][0]:.2f} over 1 min",
        flush=True)
    print(f"        quiet passes {r['quiet_passes']:g} of {r['passes']:g}; a memory locality round "
          f"{r['locality_round_ms']:.1f} ms ({r['locality_rounds']} so far), every {r['memory_check_seconds']:g} s",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=parse_points, default=[(16, 200)],
                    help="comma list of WORKERSxTHREADS (default 16x200)")
    ap.add_argument("--reconcile", default="5,1", help="comma list of reconcile periods in seconds")
    ap.add_argument("--seconds", type=float, default=60,
                    help="measurement window per point (default 60: one memory locality check falls inside)")
    ap.add_argument("--json", help="also write the results as JSON to this path ('-': stdout)")
    ap.add_argument("--before", metavar="DIR",
                    help="also run a daemon from the checkout DIR (its ascendbind package), side by side")
    ap.add_argument("--listing", action="store_true",
                    help="also run this checkout with thread_events off (the listing fallback), side by side")
    ap.add_argument("--sweep", type=int, metavar="N", action="append", default=[],
                    help="also run this checkout with drift_sweep_passes = N (variant 'sweepN'), side by side: "
                         "1 reads every mask every pass, 1000 about only the main, ACL and release threads")
    ap.add_argument("--first", metavar="NAME",
                    help="start this variant (this, listing, before) first; on a virtual machine a pass that "
                         "follows another daemon's within seconds finds warm caches, so swap the order between runs")
    ap.add_argument("--only", metavar="NAME", help="run only this variant (this, listing, sweepN, before)")
    args = ap.parse_args(argv)
    periods = [float(x) for x in args.reconcile.split(",")]
    variants = [("this", None, {})]
    if args.listing or args.only == "listing":
        variants.append(("listing", None, {"ASCENDBIND_THREAD_EVENTS": "false"}))
    for n in args.sweep:
        variants.append((f"sweep{n}", None, {"ASCENDBIND_DRIFT_SWEEP_PASSES": str(n)}))
    if args.before:
        variants.append(("before", os.path.abspath(args.before), {}))
    if args.first:
        variants.sort(key=lambda v: v[0] != args.first)
    if args.only:
        variants = [v for v in variants if v[0] == args.only]
        if not variants:
            ap.error(f"--only {args.only}: no such variant (name --before DIR for 'before')")
    print(f"idle daemon, {args.seconds:g} s window per point; CPU from schedstat, pass time from the daemon's "
          f"{HIST}")
    hdr = (f"{'daemon':>8} {'workers':>7} {'thr/w':>5} {'threads':>7} {'period':>6}  {'cpu %':>7}  {'rss MB':>6}  "
           f"{'thr':>3}  {'passes':>6}  {'pass ms':>7}  {'us/thread':>9}  {'pass cpu us/thr':>15}  {'cpu ms/pass':>11}  "
           f"{'cpu us/thread':>13}")
    print(hdr)
    rows = []
    for w, t in args.points:
        for period in periods:
            for r in measure(period, w, t, args.seconds, variants):
                rows.append(r)
                _print_row(r)
    goal = [r for r in rows if (r["workers"], r["threads_per_worker"], r["reconcile_seconds"]) == GOAL_POINT]
    for r in goal:
        cpu_ok, rss_ok = r["cpu_percent"] < GOAL_CPU_PERCENT, r["rss_mb"] < GOAL_RSS_MB
        print(f"{r['variant']}: 16 x 200 threads, reconcile 5 s ({r['reconcile_mode']} mode): idle CPU {r['cpu_percent']:.3f} % of one CPU "
              f"(goal < {GOAL_CPU_PERCENT} %: {'met' if cpu_ok else 'MISSED'}), RSS {r['rss_mb']:.1f} MB "
              f"(goal < {GOAL_RSS_MB:.0f} MB: {'met' if rss_ok else 'MISSED'}); one pass "
              f"{r['pass_ms']:.1f} ms wall = {r['pass_us_per_thread']:.2f} us per thread "
              f"({r['pass_cpu_us_per_thread']:.2f} us of the pass's CPU, {r['cpu_us_per_thread']:.2f} us of the "
              f"daemon's CPU per thread)")
    write_json(args.json, {"bench": "daemon_idle", "params": {"seconds": args.seconds}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
