"""Pid recycling on demand, inside a pid namespace of its own: run as its init.

    unshare --pid --fork --mount-proc python tests/recycle_ns.py --trials 50 [--kind pid|tid|tick] [--json]

Refuses to run unless it is pid 1 (a fresh pid namespace): it writes
``/proc/sys/kernel/ns_last_pid`` to hand a chosen number to the next process,
which must never happen to this machine's own pids.

Each trial binds a real worker process (its threads named ``worker_*``,
``acl_thread``, ``release_thread``) through an in-process ``Daemon``
(``bind_request`` as root, the fixture one-NPU npu-smi, ``small_pool = share``).
The daemon's ``before_writes`` hook runs once the request has observed and
checked the worker and right before the first affinity write; there the trial
recycles a number the bind is about to write to:

* ``pid``: the worker is killed and reaped, ``ns_last_pid`` is set to its pid
  minus one, and a stranger is started: it takes the worker's pid, and its
  threads take the worker's thread ids.
* ``tid``: one thread of the worker exits, and a stranger (one thread) is
  started on that thread's id; the worker stays.
* ``tick``: as ``pid``, but the worker (a bare ``sleep``) is started right
  after a clock tick begins and the stranger within the same tick, so both have
  the same start time in ``/proc/<pid>/stat`` (a trial where the tick ran out is
  retried).
* ``held``: the bind completes; then, still in the tick the worker was started
  in, the worker is killed and a stranger with the same start time takes its
  pid; the daemon is asked whether its worker is alive, and then runs one
  reconcile pass (even trials) or is asked to release the worker (odd ones).

After the bind, every thread of the stranger has its mask compared with the one
it was born with (each thread reads its own at birth): a stranger with any
thread moved counts as *pinned*; a daemon that holds the worker's pid after a
``pid`` or ``tick`` recycle (or, for ``held``, still calls it alive or keeps it
after the pass or the release) counts as *held*. ``undone`` is the daemon's count
of writes it found on a stranger's thread and set back
(``ascendbind_recycled_writes_total{result="undone"}``). Children are started
with posix_spawn (tests/recycle_child.py, or ``sleep``): a new process costs this
one a fraction of a millisecond of the tick, where a fork of it costs milliseconds.

Prints one line per kind, or with ``--json`` a JSON list of objects:
``{"kind": ..., "trials": N, "pinned": N, "held": N, "undone": N, "answers": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ascendbind.daemon.api.auth import Peer  # noqa: E402
from ascendbind.daemon.heart.daemon import Daemon  # noqa: E402
from ascendbind.daemon.watch.reconcile import Reconciler  # noqa: E402
from ascendbind.errors import AscendbindError  # noqa: E402
from tests.builders import fixture_config  # noqa: E402
from tests.daemon_harness import metric_value  # noqa: E402

FIXTURE_NPU_SMI = os.path.join(ROOT, "fixtures", "bin", "npu-smi")
WORKER_THREADS = ("worker_0", "worker_1", "acl_thread", "release_thread")
STRANGER_THREADS = ("s_0", "s_1", "s_2", "s_3", "s_4", "s_5")
TICK_NS = 10**9 // os.sysconf("SC_CLK_TCK")

CHILD = os.path.join(ROOT, "tests", "recycle_child.py")
SLEEP = shutil.which("sleep") or "/bin/sleep"


class Child:
    """A process spawned with named threads (tests/recycle_child.py): ``births`` maps each
    tid to (name, the mask it read at birth); ``stop(tid)`` ends one thread. A ``bare`` one
    is ``sleep``, one thread, whole the moment posix_spawn returns. Killed and reaped by
    ``close``.

    posix_spawn shares this process's memory until the exec, so a new process costs a
    fraction of a millisecond however big this one is (a fork copied its page tables, and
    its exit tore them down: milliseconds of the one clock tick a same-tick trial has). The
    start time is the spawn's, before the new program runs."""

    def __init__(self, names: tuple[str, ...], *, bare: bool = False) -> None:
        self._cmd = self._report = None
        if bare:
            self.pid = os.posix_spawn(SLEEP, ["sleep", "100000"], os.environ)
            self.births = {self.pid: (names[0], frozenset(os.sched_getaffinity(self.pid)))}
        else:
            report_r, report_w = os.pipe()
            cmd_r, cmd_w = os.pipe()
            try:
                for fd in (report_w, cmd_r):
                    os.set_inheritable(fd, True)
                self.pid = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", CHILD, str(report_w),
                                                           str(cmd_r), *names], os.environ)
            finally:
                os.close(report_w)
                os.close(cmd_r)
            self._cmd, self._report = cmd_w, os.fdopen(report_r)
        self.alive = True
        with open(f"/proc/{self.pid}/stat") as fh:
            self.start_time = int(fh.read().rpartition(")")[2].split()[19])
        if not bare:
            line = self._report.readline()
            if not line:
                raise RuntimeError(f"child {self.pid} did not report its threads")
            self.births = {int(t): (n, frozenset(m)) for t, (n, m) in json.loads(line).items()}

    def stop(self, tid: int) -> None:
        os.write(self._cmd, f"{tid}\n".encode())
        if self._report.readline().strip() != "ok":
            raise RuntimeError(f"child {self.pid} did not stop thread {tid}")
        del self.births[tid]

    def moved(self) -> list[int]:
        """The threads whose mask is no longer the one they were born with."""
        out = []
        for tid, (_name, born) in self.births.items():
            try:
                if frozenset(os.sched_getaffinity(tid)) != born:
                    out.append(tid)
            except OSError:
                continue
        return out

    def kill(self) -> None:
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)  # never reaped yet: the number is still its own
            os.waitpid(self.pid, 0)
            self.alive = False

    def close(self) -> None:
        self.kill()
        if self._cmd is not None:
            os.close(self._cmd)
            self._report.close()


def _next_pid_is(pid: int) -> None:
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(pid - 1))


class Trial:
    """One recycle, done by the bind's hook: the stranger it made, if any."""

    def __init__(self, kind: str, worker: Child) -> None:
        self.kind, self.worker = kind, worker
        self.stranger: Child | None = None
        self.target = 0  # the number handed to the stranger

    def __call__(self, *_args) -> None:
        if self.stranger is not None or self.kind == "held":
            return
        self.recycle()

    def recycle(self) -> None:
        w = self.worker
        if self.kind == "tid":
            self.target = max(t for t in w.births if t != w.pid)
            w.stop(self.target)
        else:
            self.target = w.pid
            w.kill()
        _next_pid_is(self.target)
        self.stranger = Child(("stranger",) + (() if self.kind == "tid" else STRANGER_THREADS))

    def same_tick(self) -> bool:
        return self.stranger is not None and self.stranger.start_time == self.worker.start_time


def _first_in_line() -> None:
    """Run ahead of the host's other work (SCHED_FIFO, this process and what it starts): a
    same-tick trial must start, bind, kill and start again within one clock tick, which a
    busy machine's time slices would otherwise stretch past it. The namespace ends with us."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError:
        pass  # no real-time budget here: the trials retry more


def _tick_now() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // TICK_NS


def _fresh_tick() -> None:
    """Return right after a clock tick begins, so what follows has most of a tick."""
    start = _tick_now()
    while _tick_now() == start:
        pass


def run_trials(kind: str, trials: int, state_dir: str) -> dict:
    hook: list[Trial] = []
    daemon = Daemon(fixture_config(Path(state_dir).parent, state_dir=state_dir),
                    before_writes=lambda *a: hook[-1](*a) if hook else None)
    # a bind that names its NPU is checked against npu-smi's table after its answer, and that run
    # forks in this namespace, where the trials place pids by hand: these trials are about identity
    daemon.npu_check.close()
    loop = Reconciler(daemon) if kind == "held" else None
    root = Peer(os.getpid(), 0, 0)
    out = {"kind": kind, "trials": 0, "pinned": 0, "held": 0, "undone": 0, "answers": {}, "retried": 0}
    try:
        daemon.hosts.get()  # the host's facts, once, before any trial
        if kind in ("tick", "held"):
            _first_in_line()
        while out["trials"] < trials:
            if kind in ("tick", "held"):
                _fresh_tick()
            # a same-tick worker must be whole at once: a bare one, with no threads to wait for
            worker = Child(("rworker",), bare=True) if kind in ("tick", "held") else Child(("rworker",) + WORKER_THREADS)
            trial = Trial(kind, worker)
            hook.append(trial)
            try:
                what = _bind(daemon, root, worker.pid)
                if kind == "held" and worker.pid in daemon.held:
                    trial.recycle()
                s = trial.stranger
                if s is None or s.pid != trial.target or (kind in ("tick", "held") and not trial.same_tick()):
                    out["retried"] += 1  # the number went elsewhere, or the tick ran out: not a trial
                    if out["retried"] > (200 if kind in ("tick", "held") else 20) * trials + 100:
                        raise RuntimeError(f"{kind}: could not recycle a number {out['retried']} times "
                                           f"in {out['trials']} trials")
                    continue
                if kind == "held":
                    what = _held_verdict(daemon, loop, worker.pid, out["trials"] % 2)
                out["trials"] += 1
                out["pinned"] += bool(s.moved())
                out["answers"][what] = out["answers"].get(what, 0) + 1
                out["held"] += daemon.reader.holds(worker.pid) and kind != "tid"
            finally:
                hook.pop()
                if trial.stranger is not None:
                    trial.stranger.close()
                worker.kill()
                daemon.drop(worker.pid, "exited")
                worker.close()
        out["undone"] = int(metric_value(daemon.metrics.render().decode(), "ascendbind_recycled_writes_total",
                                         result="undone") or 0)
    finally:
        if loop is not None:
            loop.close()
        daemon.close()
    return out


def _bind(daemon: Daemon, root: Peer, pid: int) -> str:
    """Bind ``pid`` as root over the daemon's request path; what it answered, in short."""
    try:
        answer = daemon.bind_request(root, {"pid": pid, "npu": 0})
    except AscendbindError as exc:
        return f"{type(exc).__name__} {exc.code}"
    what = f"200 {answer['status']}"
    steps = {s["step"]: s["reason"] for s in answer["steps"]}
    return what + (f" affinity={steps['affinity']}" if steps.get("affinity") else "")


def _held_verdict(daemon: Daemon, loop: Reconciler, pid: int, release: int) -> str:
    """What the daemon makes of its bound worker once a same-tick stranger has its pid:
    whether it still calls it alive, then what a reconcile pass or a release does."""
    alive = daemon.is_alive(daemon.reader.get(pid))
    if release:
        try:
            answer = daemon.release_pid(pid)
            what = "released" if answer.get("steps") else "dropped on release"
        except AscendbindError as exc:
            what = f"release {exc.code}"
    else:
        loop.pass_once()
        what = "kept by the loop" if pid in daemon.held else "dropped by the loop"
    return f"{'alive' if alive else 'gone'}, {what}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--kind", action="append", choices=("pid", "tid", "tick", "held"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.getpid() != 1:
        print("refusing to recycle pids outside a pid namespace of our own (run under "
              "unshare --pid --fork --mount-proc)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    import logging

    import structlog

    # the daemon's info lines (one bind per trial) would bury the figures
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
                        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    results = []
    with tempfile.TemporaryDirectory(prefix="recycle-") as tmp:
        for kind in args.kind or ["pid"]:
            os.mkdir(os.path.join(tmp, kind), 0o700)
            t0 = time.monotonic()
            r = run_trials(kind, args.trials, os.path.join(tmp, kind))
            r["seconds"] = round(time.monotonic() - t0, 2)
            results.append(r)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(f"{r['kind']}: {r['pinned']} of {r['trials']} strangers left pinned, {r['held']} held as the "
                  f"worker, {r['undone']} writes undone ({r['retried']} retries, {r['seconds']} s); "
                  f"answers {r['answers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
