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
namespaces (the QEMU guest). Prints a JSON summary: p50, p99, max, and how many
were not moved within 5 s.
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
