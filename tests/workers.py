"""A real worker process with real named threads, for tests that bind for real.

    with start_worker(plain=3, acl=1, release=1) as w:
        w.pid, w.start_time        # the child process
        w.threads()                # {tid: comm} read from /proc/<pid>/task/*/comm
        tid = w.spawn("acl_thread_2")   # start a late named thread, returns its tid
        w.born_cpus(tid)           # the CPUs that thread was allowed at birth (read by itself)
        w.narrow_main({0})         # the main thread pins itself (as OpenMP's OMP_PROC_BIND does)
        w.rename(tid, "acl_thread")  # rename a thread of the worker afterwards (as a runtime can)
        w.stop(tid)                # make that thread exit (returns once /proc no longer lists it)
        w.churn(True)              # keep creating short-lived threads until churn(False)
        w.exec_as(path)            # replace its image (same pid), named after ``path``
        w.cpus_allowed()           # {tid: frozenset} from /proc/<pid>/task/*/status
    # leaving the block always kills and reaps the child

The child is ``python3 -c <script>`` driven over stdin/stdout, one command per
line; every thread names itself with prctl(PR_SET_NAME) before it reports its
tid, so a tid returned by ``spawn`` already carries its comm. Thread names are
kernel ``comm`` values: at most 15 bytes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from ascendbind.values.cpulist import parse_cpulist
from tests.threadname import program

__all__ = ["PipeChild", "Worker", "start_worker", "cpus_allowed_of", "online_nodes", "small_pool_plan", "reap", "SELF_BINDER"]

_CHILD = program(r"""
import os, sys, threading, time
stops = {}
born = {}
def run(name, ready, stop):
    name_self(name)
    tid = threading.get_native_id()
    born[tid] = sorted(os.sched_getaffinity(0))
    ready.put(tid)
    stop.wait()
import queue
def spawn(name):
    q = queue.Queue(); ev = threading.Event()
    t = threading.Thread(target=run, args=(name, q, ev), daemon=True)
    t.start()
    tid = q.get()
    stops[tid] = (ev, t)
    return tid
import hashlib
MIB = bytes(1 << 20)
burned = {}
def burner(name, ms, ready, stop):
    name_self(name)
    tid = threading.get_native_id()
    born[tid] = sorted(os.sched_getaffinity(0))
    done = burned[tid] = threading.Event()
    ready.put(tid)
    # hashing a MiB lets go of the GIL: burners contend for the CPU (run-queue delay),
    # not for the interpreter lock (a sleep on a futex, which no run queue sees)
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        hashlib.sha256(MIB).digest()
    done.set()
    stop.wait()
def burn(name, ms):
    q = queue.Queue(); ev = threading.Event()
    t = threading.Thread(target=burner, args=(name, ms, q, ev), daemon=True)
    t.start()
    tid = q.get()
    stops[tid] = (ev, t)
    return tid
# The churner runs batches of short-lived threads while `want` is set; `busy` is
# flipped under the same lock, so "churn off" can wait until no batch is running.
cond = threading.Condition()
want = False
busy = False
def churn_loop():
    global busy
    name_self("churner")
    while True:
        with cond:
            busy = False
            cond.notify_all()
            cond.wait_for(lambda: want)
            busy = True
        ts = [threading.Thread(target=time.sleep, args=(0.002,), daemon=True) for _ in range(8)]
        for t in ts: t.start()
        for t in ts: t.join()
threading.Thread(target=churn_loop, daemon=True).start()
for name in sys.argv[1:]:
    spawn(name)
out = sys.stdout
out.write("ready\n"); out.flush()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "spawn":
        out.write(f"{spawn(arg)}\n")
    elif cmd == "burn":
        # `count` threads named `name` each burn `ms` of their own CPU time at once (contending
        # when their masks share CPUs), then wait like spawned threads; answers their tids once done
        name, ms, count = arg.split()
        tids = [burn(name, int(ms)) for _ in range(int(count))]
        for tid in tids:
            burned[tid].wait()
        out.write(" ".join(map(str, tids)) + "\n")
    elif cmd == "stop":
        ev, t = stops.pop(int(arg))
        ev.set(); t.join()
        out.write("ok\n")
    elif cmd == "rename":
        # a process may rename any of its own threads through /proc (another process may not)
        tid, _, name = arg.partition(" ")
        with open(f"/proc/self/task/{tid}/comm", "w") as fh:
            fh.write(name[:15])
        out.write("ok\n")
    elif cmd == "narrow":
        # the calling thread pins itself, as libgomp does with OMP_PROC_BIND before any binder runs
        os.sched_setaffinity(0, {int(c) for c in arg.split(",")})
        out.write("ok\n")
    elif cmd == "born":
        out.write(",".join(map(str, born[int(arg)])) + "\n")
    elif cmd == "churn":
        with cond:
            want = arg == "on"
            cond.notify_all()
            if not want:
                cond.wait_for(lambda: not busy)
        # the threads every later listing must show: this one, the churner, the named ones
        out.write(f"{threading.active_count()}\n")
    elif cmd == "exec":
        # replace the image, as a launcher that execs its runtime does: same pid and start
        # time, one thread left, named after the new executable (no rename event)
        out.write("ok\n"); out.flush()
        os.execv(arg, [arg, "-c", "import sys; sys.stdin.read()"])
    elif cmd == "quit":
        break
    else:
        out.write("?\n")
    out.flush()
""")


# A child that keeps undoing any binding, as an in-process binder does: prints
# "ready", then resets its own mask to every CPU it may use (its mask at start, before any
# bind: on a machine whose CPUs are not numbered 0..n-1 too) five times a second.
SELF_BINDER = r"""
import os, sys, time
allcpus = os.sched_getaffinity(0)
sys.stdout.write("ready\n"); sys.stdout.flush()
while True:
    os.sched_setaffinity(0, allcpus)   # an in-process binder that keeps undoing ours
    time.sleep(0.2)
"""


def _wait(predicate, timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass (an event wait, not a sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


def nodes_with_cpus() -> set[int]:
    """The NUMA nodes holding at least one CPU, from this kernel's sysfs (the fixture NPU's
    pool is every CPU: aligned, and one preferred memory node, only where this is one node)."""
    base = "/sys/devices/system/node"
    nodes = set()
    for name in os.listdir(base):
        if name[4:].isdigit():
            with open(f"{base}/{name}/cpulist") as fh:
                if fh.read().strip():
                    nodes.add(int(name[4:]))
    return nodes


def cpus_allowed_of(pid: int, tid: int) -> frozenset[int] | None:
    """``Cpus_allowed_list`` of one thread, read from /proc/<pid>/task/<tid>/status."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as fh:
            for line in fh:
                if line.startswith("Cpus_allowed_list:"):
                    return parse_cpulist(line.split(":", 1)[1])
    except OSError:
        return None
    return None


def reap(proc: subprocess.Popen) -> None:
    """Kill a pipe-driven child if it still runs, wait for it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for fh in (proc.stdin, proc.stdout):
        if fh:
            fh.close()


def online_nodes() -> frozenset[int]:
    """The NUMA nodes this machine has online (a worker's pages can be on these only)."""
    with open("/sys/devices/system/node/online") as fh:
        return frozenset(parse_cpulist(fh.read().strip()))


class PipeChild:
    """A child process driven over its stdin/stdout, one command per line, one answer line
    each; its pid and start time read at once. ``close`` kills and reaps it."""

    def __init__(self, proc: subprocess.Popen, *, pid: int | None = None) -> None:
        # ``pid``: the worker's host pid when ``proc`` is a launcher around it (tests/containers.py)
        self.proc = proc
        self.pid = proc.pid if pid is None else pid
        with open(f"/proc/{self.pid}/stat") as fh:
            self.start_time = int(fh.read().rpartition(")")[2].split()[19])

    def _ask(self, line: str) -> str:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        if not reply or reply == "?":
            raise RuntimeError(f"worker {self.pid} did not answer {line!r}")
        return reply

    def rename(self, tid: int, name: str) -> None:
        """The child renames its own thread ``tid`` to ``name`` (<= 15 bytes; a program that
        knows the command: tests/workers.py's, the Python flooder); returns once done."""
        self._ask(f"rename {tid} {name}")

    def close(self) -> None:
        reap(self.proc)


class Worker(PipeChild):

    def spawn(self, name: str) -> int:
        """Start a thread named ``name`` (<= 15 bytes); returns its tid once named."""
        return int(self._ask(f"spawn {name}"))

    def burn(self, name: str, ms: int, count: int = 1) -> list[int]:
        """Start ``count`` threads named ``name`` that each burn ``ms`` of CPU time at once;
        returns their tids once all have (they then wait, as spawned threads do)."""
        return [int(t) for t in self._ask(f"burn {name} {ms} {count}").split()]

    def narrow_main(self, cpus) -> None:
        """The worker's main thread sets its own mask to ``cpus`` (other threads keep theirs)."""
        self._ask("narrow " + ",".join(map(str, sorted(cpus))))

    def born_cpus(self, tid: int) -> frozenset[int]:
        """The CPUs a thread started by ``spawn`` was allowed when it started, as it
        read them itself: no race with anything that re-pins it afterwards."""
        return frozenset(int(c) for c in self._ask(f"born {tid}").split(","))

    def stop(self, tid: int) -> None:
        """Make a thread started by ``spawn`` exit; returns once the kernel no longer
        lists it (a joined thread can linger in /proc/<pid>/task until it is released)."""
        self._ask(f"stop {tid}")
        if not _wait(lambda: not os.path.exists(f"/proc/{self.pid}/task/{tid}")):
            raise RuntimeError(f"thread {tid} of worker {self.pid} still listed after it exited")

    def exec_as(self, path: str) -> None:
        """The worker execs ``path`` (a Python interpreter, perhaps under another name) and
        waits on stdin; returns once the kernel shows it single-threaded under the new name."""
        self._ask(f"exec {path}")
        name = os.path.basename(path)[:15]

        def done() -> bool:
            try:
                with open(f"/proc/{self.pid}/comm") as fh:
                    return fh.read().strip() == name and len(os.listdir(f"/proc/{self.pid}/task")) == 1
            except OSError:
                return False

        if not _wait(done):
            raise RuntimeError(f"worker {self.pid} did not exec {path}")

    def churn(self, on: bool) -> None:
        """Start/stop a loop creating short-lived threads (8 at a time, ~2 ms each).
        ``churn(False)`` returns once the last batch has been joined *and* the kernel
        lists only the long-lived threads again, so a later listing is stable."""
        expected = int(self._ask("churn on" if on else "churn off"))
        if not on and not _wait(lambda: len(os.listdir(f"/proc/{self.pid}/task")) == expected):
            raise RuntimeError(f"worker {self.pid} still lists short-lived threads after churn off")

    def threads(self) -> dict[int, str]:
        out = {}
        for name in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{name}/comm") as fh:
                    out[int(name)] = fh.read().rstrip("\n")
            except OSError:
                continue
        return out

    def tid_named(self, name: str) -> int:
        """The tid of the worker's thread named ``name`` (the first, if several are)."""
        return next(tid for tid, comm in self.threads().items() if comm == name)

    def cpus_allowed(self) -> dict[int, frozenset[int]]:
        """tid -> Cpus_allowed_list for every live thread."""
        out = {}
        for tid in self.threads():
            cpus = cpus_allowed_of(self.pid, tid)
            if cpus is not None:
                out[tid] = cpus
        return out


@contextlib.contextmanager
def start_worker(plain: int = 2, acl: int = 1, release: int = 1, names: tuple[str, ...] = ()) -> Iterator[Worker]:
    """A child with ``plain`` threads named ``worker_<i>``, ``acl`` named ``acl_thread[_i]``,
    ``release`` named ``release_thread[i]`` plus any extra ``names``; always reaped."""
    all_names = [f"worker_{i}" for i in range(plain)]
    all_names += ["acl_thread" if i == 0 else f"acl_thread_{i}" for i in range(acl)]
    all_names += ["release_thread" if i == 0 else f"release_thread{i}" for i in range(release)]
    all_names += list(names)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *all_names],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = None
    try:
        assert proc.stdout
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("test worker did not start")
        worker = Worker(proc)
        yield worker
    finally:
        if worker is not None:
            worker.close()
        else:
            proc.kill()
            proc.wait(timeout=10)


def small_pool_plan(cpus: list[int] | tuple[int, ...], npu: int = 0):
    """The NpuPlan the role split gives a pool under ``small_pool = "share"`` (2+ CPUs:
    irq = [pool[0]], main = pool[:-1], acl = release = [pool[-1]]; 1 CPU: all)."""
    from ascendbind.values.model import NpuPlan

    pool = tuple(sorted(cpus))
    if len(pool) == 1:
        return NpuPlan(npu, pool, pool, pool, pool, pool, (0,))
    return NpuPlan(npu, pool, pool[:1], pool[:-1], pool[-1:], pool[-1:], (0,))
