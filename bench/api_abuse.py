"""Root's bind latency through the socket while others abuse the daemon's listeners.

    .venv/bin/python bench/api_abuse.py [--binds 30] [--idle 200] [--trickle 8] [--flood 1100]

Starts ``ascendbind serve`` on the fake one-NPU host and one worker, then times
``--binds`` bind + release round trips of root (connect to answer, monotonic
clock) in three conditions, side by side:

* ``quiet``     nobody else connects;
* ``socket``    uid 65534 keeps ``--idle`` connections open that never send a
                byte (reconnecting each as soon as it is closed) and ``--trickle``
                that send a request a byte a second (tests/http_abuse.py);
* ``metrics``   ``--flood`` idle TCP connections to the metrics port.

Prints, per condition, the median and maximum bind time, the binds that failed,
the daemon's open descriptors, and the abuser's counts (connects refused for a
full backlog, answers by status). Goal: every bind answered, max < 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ascendbind.client import Client  # noqa: E402
from ascendbind.errors import AscendbindError  # noqa: E402
from tests.daemon_harness import running_daemon  # noqa: E402
from tests.workers import start_worker  # noqa: E402


def time_binds(client: Client, pid: int, n: int) -> dict:
    took, failed = [], 0
    for _ in range(n):
        t0 = time.monotonic()
        try:
            client.bind(pid=pid, npu=0)
            took.append(time.monotonic() - t0)
            client.release(pid=pid)
        except AscendbindError:
            failed += 1
    return {"binds": n, "failed": failed, "median_ms": round(statistics.median(took) * 1000, 1) if took else None,
            "max_ms": round(max(took) * 1000, 1) if took else None}


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binds", type=int, default=30)
    ap.add_argument("--idle", type=int, default=200)
    ap.add_argument("--trickle", type=int, default=8)
    ap.add_argument("--flood", type=int, default=1100)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.flood + 512)), hard))
    directory = tempfile.mkdtemp(prefix="ascendbind-abuse-", dir="/tmp")
    os.chmod(directory, 0o755)
    out: dict = {}
    try:
        with running_daemon(directory) as d, start_worker(plain=1, acl=0, release=0) as w:
            d.wait_discovered()
            os.chmod(d.sock, 0o666)
            client = Client(d.sock, timeout=30)
            out["quiet"] = {**time_binds(client, w.pid, args.binds), "daemon_fds": fds(d.pid)}

            py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
            abuser = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py,
                                       os.path.join(ROOT, "tests", "http_abuse.py"), d.sock, "--idle",
                                       str(args.idle), "--trickle", str(args.trickle)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert abuser.stdout.readline().strip() == "ready"
            time.sleep(3)  # a benchmark, not a test: let the abuse reach its steady state (deadlines firing)
            result = time_binds(client, w.pid, args.binds)
            result["daemon_fds"] = fds(d.pid)
            stats, _ = abuser.communicate(input="", timeout=60)
            result["abuser"] = json.loads(stats.strip().splitlines()[-1])
            out["socket"] = result

            conns = [socket.create_connection(("127.0.0.1", d.port), timeout=10) for _ in range(args.flood)]
            try:
                result = time_binds(client, w.pid, args.binds)
                result["daemon_fds"] = fds(d.pid)
            finally:
                for s in conns:
                    s.close()
            out["metrics"] = result
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(out, indent=2))
    ok = all(r["failed"] == 0 and r["max_ms"] is not None and r["max_ms"] < 1000 for r in out.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
