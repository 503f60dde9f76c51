"""What an idle daemon costs: CPU and memory with a few bound workers (issue 4).

    .venv/bin/python bench/daemon_idle.py [--workers 4] [--threads 16] [--seconds 30]

Starts ``ascendbind serve`` on the fixture one-NPU host (allow_shared_npu, so
several workers share NPU 0), binds N real workers of T named threads each
through the socket, then measures over the window, for reconcile_seconds = 5
(the default) and 1: the daemon's CPU time (utime + stime from /proc/<pid>/stat)
as a share of one CPU, its RSS (VmRSS), its thread count, and reconcile passes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.daemon_harness import DaemonProc, base_env, free_port, metric_value, wait_for  # noqa: E402
from tests.workers import start_worker  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def status_field(pid: int, key: str) -> str:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return "?"


def measure(reconcile: float, n_workers: int, n_threads: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = base_env(f"{tmp}/s.sock", f"{tmp}/state", free_port(), ASCENDBIND_ALLOW_SHARED_NPU="true",
                       ASCENDBIND_RECONCILE_SECONDS=str(reconcile))
        d = DaemonProc(tmp, env).start()
        workers = []
        try:
            d.wait_discovered()
            for _ in range(n_workers):
                cm = start_worker(plain=n_threads - 2, acl=1, release=1)
                w = cm.__enter__()
                workers.append((cm, w))
                d.client.bind(pid=w.pid, npu=0)
            assert wait_for(lambda: len(d.client.workers()["workers"]) == n_workers, 5)
            time.sleep(2)  # let start-up settle
            runs0 = metric_value(d.metrics_text(), "ascendbind_reconcile_runs_total")
            c0, t0 = cpu_seconds(d.pid), time.monotonic()
            time.sleep(seconds)
            c1, t1 = cpu_seconds(d.pid), time.monotonic()
            runs1 = metric_value(d.metrics_text(), "ascendbind_reconcile_runs_total")
            return {
                "reconcile_seconds": reconcile,
                "cpu_percent": 100 * (c1 - c0) / (t1 - t0),
                "rss": status_field(d.pid, "VmRSS"),
                "threads": status_field(d.pid, "Threads"),
                "passes": runs1 - runs0,
            }
        finally:
            for cm, _w in workers:
                cm.__exit__(None, None, None)
            d.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30)
    args = ap.parse_args()
    print(f"{args.workers} bound workers x {args.threads} threads, {args.seconds:g} s window")
    print(f"{'reconcile_s':>11}  {'cpu %':>7}  {'rss':>10}  {'threads':>7}  {'passes':>6}")
    for reconcile in (5.0, 1.0):
        r = measure(reconcile, args.workers, args.threads, args.seconds)
        print(f"{r['reconcile_seconds']:>11g}  {r['cpu_percent']:>7.3f}  {r['rss']:>10}  {r['threads']:>7}  "
              f"{r['passes']:>6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
