"""``python -m ascendbind.demo`` (``make run``): the daemon binding a real worker.

1. starts ``ascendbind serve`` in a temp directory (socket, state dir, metrics
   on a free loopback port, reconcile every second, ``small_pool = "share"``),
   with the bundled fixture ``npu-smi`` first on PATH: it describes this
   machine as an Atlas A2 host with one "Ascend 910B3" NPU;
2. starts a demo worker whose threads are named like an inference worker's;
3. asks the daemon, through its Unix socket, to bind the worker to NPU 0, and
   prints every thread's CPUs before and after;
4. has the worker start a late ``acl_thread`` and shows the reconcile loop
   moving it to the ACL CPU; prints the bind counter from /metrics;
5. releases the worker, stops the daemon and removes the temp directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .applier.affinity import role_of
from .client import Client
from .values.cpulist import format_cpulist
from .discovery.gather.process import thread_masks
from .errors import AscendbindError

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_BIN = ROOT / "fixtures" / "bin"
THREAD_NAMES = ("worker_0", "worker_1", "acl_thread", "release_thread")

_WORKER = r"""
import ctypes, sys, threading
libc = ctypes.CDLL(None)
def run(name, ready):
    libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    ready.set()
    threading.Event().wait()
def spawn(name):
    ready = threading.Event()
    threading.Thread(target=run, args=(name, ready), daemon=True).start()
    ready.wait()
for name in sys.argv[1:]:
    spawn(name)
print("ready", flush=True)
for line in sys.stdin:          # "spawn NAME" starts a late thread
    spawn(line.split()[1]); print("ok", flush=True)
"""


def _threads(pid: int) -> list[str]:
    masks = thread_masks(pid)
    return [f"  tid {tid:<8} {masks[tid][0]:<16} {role_of(masks[tid][0]):<8} CPUs {format_cpulist(masks[tid][1])}"
            for tid in sorted(masks)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if predicate():
                return True
        except AscendbindError:
            pass
        time.sleep(0.1)
    return False


def _daemon_env(tmp: str, sock: str, port: int) -> dict[str, str]:
    """The environment of the demo daemon: everything under ``tmp``, the fixture npu-smi first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCENDBIND_", "NOTIFY_SOCKET", "LISTEN_"))}
    env.update(ASCENDBIND_SOCKET=sock, ASCENDBIND_STATE_DIR=os.path.join(tmp, "state"), ASCENDBIND_CONFIG="",
               ASCENDBIND_METRICS_LISTEN=f"127.0.0.1:{port}", ASCENDBIND_RECONCILE_SECONDS="1",
               ASCENDBIND_SMALL_POOL="share", PATH=f"{FIXTURE_BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def _daemon_log(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _show_bind(client: Client, sock: str, pid: int) -> dict:
    """Binds the worker to NPU 0, printing its threads before and after; the plan of NPU 0."""
    print(f"demo worker pid {pid}\n\nbefore:")
    print("\n".join(_threads(pid)))
    print(f"\n$ curl --unix-socket {sock} -d '{{\"pid\": {pid}, \"npu\": 0}}' http://localhost/v1/bind")
    result = client.bind(pid=pid, npu=0)
    p = result["plan"]["npus"]["0"]
    print(f"bound ({result['outcome']}): pool {format_cpulist(p['pool'])}  main {format_cpulist(p['main'])}  "
          f"acl {format_cpulist(p['acl'])}  release {format_cpulist(p['release'])}")
    for s in result["steps"]:
        print(f"  {s['step']:<8} {s['outcome']:<8} {s['reason'] or '-':<20} {s['detail'][:90]}")
    print("\nafter:")
    print("\n".join(_threads(pid)))
    return p


def _show_late_thread(worker: subprocess.Popen, client: Client, pid: int, plan: dict) -> None:
    """Has the worker start a late ACL thread and shows the reconcile loop moving it."""
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write("spawn acl_thread_2\n")
    worker.stdin.flush()
    worker.stdout.readline()
    print("\nthe worker starts a late acl_thread_2; the reconcile loop pins it within a second or two:")
    _wait(lambda: any(c == "acl_thread_2" and m == set(plan["acl"]) for c, m in thread_masks(pid).values()), 5)
    print("\n".join(line for line in _threads(pid) if "acl_thread_2" in line))
    counter = [ln for ln in client.metrics().splitlines() if ln.startswith("ascendbind_bind_requests_total")]
    print("\n" + "\n".join(counter))


def _stop(worker: subprocess.Popen, daemon: subprocess.Popen) -> None:
    if worker.stdin:
        worker.stdin.close()
    worker.kill()
    worker.wait()
    daemon.terminate()
    try:
        daemon.wait(timeout=10)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


def main() -> int:
    if not (FIXTURE_BIN / "npu-smi").exists():
        print(f"demo: the fixture npu-smi is missing ({FIXTURE_BIN}); run from a source checkout", file=sys.stderr)
        return 1
    # A demo stopped by kill or a closed terminal stops its daemon and worker too (the finally
    # below), as Ctrl-C does.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda n, _frame: sys.exit(128 + n))
    tmp = tempfile.mkdtemp(prefix="ascendbind-demo-")
    sock = os.path.join(tmp, "ascendbind.sock")
    port = _free_port()
    log_path = os.path.join(tmp, "daemon.log")
    log = open(log_path, "w")
    daemon = subprocess.Popen([sys.executable, "-m", "ascendbind.cli", "serve"], env=_daemon_env(tmp, sock, port),
                              stdout=log, stderr=subprocess.STDOUT)
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, *THREAD_NAMES], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    client = Client(sock, timeout=30)
    try:
        if worker.stdout is None or worker.stdout.readline().strip() != "ready":
            print("demo: the demo worker did not start", file=sys.stderr)
            return 1
        if not _wait(lambda: client.health()["discovery"] == "ok", 20):
            print("demo: the daemon did not come up; its log:\n" + _daemon_log(log_path), file=sys.stderr)
            return 4
        pid = worker.pid
        print(f"daemon pid {daemon.pid} on {sock} (metrics http://127.0.0.1:{port}/metrics)")
        plan = _show_bind(client, sock, pid)
        _show_late_thread(worker, client, pid, plan)
        client.release(pid)
        print("\nreleased; after release:")
        print("\n".join(_threads(pid)))
        return 0
    except AscendbindError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return exc.exit_status
    finally:
        _stop(worker, daemon)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
