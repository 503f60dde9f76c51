"""How soon ``isolation = host`` moves a process started after the bind.

    .venv/bin/python bench/isolation_host.py [--starts 100]

Runs tests/hostlevel_ns.py (init of a pid namespace of its own: the daemon moves
every process it sees, so never this machine's) with ``ascendbind serve`` at
``isolation = host`` on the fake two-NPU host (a worker bound on NPU 1 protects
CPU 1). Then, ``--starts`` times, init forks a child that execs ``sleep``: the
child inherits init's mask, which the level never changes, so only the watcher
can move it; each fork comes at a random point of the watcher's period. Each figure is the time from just before the fork to the first
read-back of ``/proc/<pid>/task/*/status`` that shows no protected CPU. In a pid
namespace the kernel's process connector does not answer, so this measures the
*sweep* mode (a ``/proc`` listing every 50 ms); events mode needs the initial
namespaces. Prints a JSON summary: p50, p99, max, and how many were not moved
within 5 s.

Beside it, what events mode adds instead of the listing period: on this machine
(reading only: nothing is moved here) a socket with the watcher's kernel-side
filter is opened, ``--starts`` children are forked and exec ``true``, and each
time from just before the fork to the read of its fork event is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "tests", "hostlevel_ns.py")


def call(p: subprocess.Popen, op: str, **kw):
    p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
    p.stdin.flush()
    if not select.select([p.stdout], [], [], 600)[0]:
        raise SystemExit(f"no answer to {op}")
    out = json.loads(p.stdout.readline())
    if isinstance(out, dict) and "error" in out:
        raise SystemExit(f"{op}: {out['error']}")
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def event_delivery(starts: int) -> dict | None:
    """Fork to the watcher's read of the fork event, ``starts`` times (None: no connector here)."""
    sys.path.insert(0, ROOT)
    from ascendbind.discovery.read.proc_connector import ProcEventSocket
    from ascendbind.discovery.parse.proc_events import parse_events, process_start_filter, started_processes
    from ascendbind.errors import DiscoveryError

    try:
        src = ProcEventSocket.open(program=process_start_filter())
    except DiscoveryError:
        return None
    took = []
    try:
        for _ in range(starts):
            src.read()  # whatever the host started meanwhile
            t0 = time.monotonic()
            child = subprocess.Popen(["true"])
            seen = False
            while not seen and time.monotonic() - t0 < 5:
                select.select([src], [], [], 1)
                datagrams, _lost = src.read()
                seen = child.pid in started_processes(e for d in datagrams for e in parse_events(d))[0]
            took.append(1000 * (time.monotonic() - t0))
            child.wait()
    finally:
        src.close()
    return {"p50": round(statistics.median(took), 2), "p99": round(quantile(took, 0.99), 2),
            "max": round(max(took), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=100)
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("needs root and unshare", file=sys.stderr)
        return 2
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, HARNESS],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        p.stdout.readline()
        call(p, "daemon", env={"ASCENDBIND_ISOLATION": "host"})
        worker = call(p, "spawn", comm="worker", threads=1)["pid"]
        assert call(p, "curl", method="POST", path="/v1/bind", body={"pid": worker, "npu": 1})["code"] == 200
        iso = call(p, "status")["isolation"]
        took = call(p, "starts", cpus=iso["protected"], count=args.starts)["seconds"]
        iso = call(p, "status")["isolation"]
        moved = [1000 * t for t in took if t is not None]
        summary = {
            "mode": iso["tasks"]["events"]["mode"], "starts": args.starts, "not_moved_within_5s": took.count(None),
            "protected": iso["protected"], "housekeeping": iso["housekeeping"],
            "start_to_move_ms": {"p50": round(statistics.median(moved), 1), "p99": round(quantile(moved, 0.99), 1),
                                 "max": round(max(moved), 1), "mean": round(statistics.fmean(moved), 1)},
            "slowest_ms": [round(t, 1) for t in sorted(moved)[-5:]],
            "first_ms": [round(t, 1) for t in moved[:3]],
            "load": round(os.getloadavg()[0], 2),
        }
        summary["event_delivery_ms"] = event_delivery(args.starts)
        print(json.dumps(summary, indent=1))
    finally:
        try:
            p.stdin.write('{"op": "exit"}\n')
            p.stdin.flush()
            p.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
