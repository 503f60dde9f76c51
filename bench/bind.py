"""Binding speed: the applier against the reference path, the daemon and a bare loop.

    .venv/bin/python bench/bind.py [--runs N] [--threads N] [--no-daemon] [--json PATH]

One worker process with N named threads (default 200: mostly plain, 4
``acl_thread*``, 4 ``release_thread*``) is bound again and again by four
contenders, alternated within each round so drift hits them all alike:

* ``reference``   what a script-based binder runs per worker, as subprocesses:
                  ``npu-smi info -m``, ``npu-smi info``, ``npu-smi info -t topo``,
                  ``lscpu -e=CPU,NODE``, ``ps -Te``, ``taskset -acp <main> <pid>``,
                  one ``taskset -cp`` per acl/release thread, ``npu-smi info -t
                  board -i 0`` (its ``systemctl`` and ``migratepages`` calls are
                  left out, which only flatters it), with the fixture npu-smi;
* ``reference-floor`` the same argv with ``npu-smi`` replaced by ``true``: the
                  reference's cost with a free npu-smi;
* ``apply_plan``  ascendbind's applier, all four steps (host facts discovered once,
                  as the daemon caches them);
* ``bind_threads`` the applier's affinity step alone, holding the worker by a pin
                  (its pidfd, opened once, as a held record's): each mask read
                  before it is written, every write confirmed afterwards;
* ``daemon``      POST /v1/bind to a real ``ascendbind serve`` (fixture one-NPU
                  host, ``small_pool = share``) through ascendbind.client: the
                  socket round trip, the worker's observation, the plan, all four
                  steps and the state file; the worker is released, untimed,
                  before each bind;
* ``daemon-core`` the same bind in-process (``Daemon.bind_request`` with the peer
                  the socket would give): the daemon without socket, HTTP and
                  client, state file included;
* ``core-no-state`` diagnostic: ``daemon-core`` with the state-file writes left out
                  (a daemon must never answer a bind before it is durable; this
                  row only shows how much of the bind the state file is);
* ``round-trip``  GET /v1/health through the same client: what the socket, HTTP
                  and client cost a request that does no work;
* ``bare``        a loop of the same /proc reads and syscalls as bind_threads
                  (list tasks, read comm, sched_getaffinity, sched_setaffinity,
                  sched_getaffinity, re-list until stable, one poll of a pidfd)
                  with no ascendbind code.

Prints the median of each and the ratios, and where the daemon's binds spent their
time, phase by phase (``ascendbind_bind_phase_seconds_total``: the caller's
credentials, the worker's identity, the rest of its observation, the plan, the
steps, the record, the answer). Goals: daemon / bare <= 1.5,
reference / daemon and reference / apply_plan >= 10 (also against the floor),
bind_threads / bare <= 1.5. ``bare`` is the in-process floor: no binder, in or
out of process, can set the masks faster. Then the reconcile pass's cost per
thread (bench/reconcile_pass.py's cached look, ``--reconcile-workers`` workers
of the same size, back to back), so the bind and the upkeep of a binding are
read side by side.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ascendbind.applier import apply_plan  # noqa: E402
from ascendbind.applier.affinity import bind_threads  # noqa: E402
from ascendbind.values.config import Config  # noqa: E402
from ascendbind.discovery import LiveHost, discover_host, discover_worker  # noqa: E402
from ascendbind.discovery.read.pin import open_pin  # noqa: E402
from ascendbind.planner import make_plan  # noqa: E402
from ascendbind.daemon.api.auth import Peer  # noqa: E402
from ascendbind.daemon.heart.daemon import Daemon  # noqa: E402
from ascendbind.daemon.api.metrics import BIND_PHASES  # noqa: E402
from bench.common import write_json  # noqa: E402
from tests.daemon_harness import DaemonProc, base_env, free_port, metric_value  # noqa: E402
from tests.workers import start_worker  # noqa: E402

FIXTURE_BIN = os.path.join(ROOT, "fixtures", "bin")

def run_quiet(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=False)


def reference(pid: int, main: list[int], acl: list[int], rel: list[int], npu_smi: str) -> None:
    env = dict(os.environ, LC_ALL="C", LANG="C")
    run_quiet([npu_smi, "info", "-m"], env)
    run_quiet([npu_smi, "info"], env)
    run_quiet([npu_smi, "info", "-t", "topo"], env)
    run_quiet(["lscpu", "-e=CPU,NODE"], env)
    out = run_quiet(["ps", "-Te"], env).stdout
    acl_tids, rel_tids = [], []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0] != str(pid):
            continue
        if "acl_thread" in line:
            acl_tids.append(parts[1])
        elif "release_thread" in line:
            rel_tids.append(parts[1])
    run_quiet(["taskset", "-acp", ",".join(map(str, main)), str(pid)], env)
    for tid in acl_tids:
        run_quiet(["taskset", "-cp", ",".join(map(str, acl)), tid], env)
    for tid in rel_tids:
        run_quiet(["taskset", "-cp", ",".join(map(str, rel)), tid], env)
    run_quiet([npu_smi, "info", "-t", "board", "-i", "0"], env)


def bare(pid: int, main: frozenset, acl: frozenset, rel: frozenset, pidfd: int) -> int:
    task = f"/proc/{pid}/task"
    seen: set[str] = set()
    before = {}
    bad = 0
    for _ in range(8):
        new = [n for n in os.listdir(task) if n not in seen]
        if not new:
            break
        for n in new:
            seen.add(n)
            try:
                fd = os.open(f"{task}/{n}/comm", os.O_RDONLY)
            except OSError:
                continue
            try:
                comm = os.read(fd, 64).decode()
            finally:
                os.close(fd)
            cpus = acl if comm.startswith("acl_thread") else rel if comm.startswith("release_thread") else main
            tid = int(n)
            try:
                before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cpus)
                if os.sched_getaffinity(tid) != cpus:
                    bad += 1
            except ProcessLookupError:
                pass
    poller = select.poll()  # the last listing confirms the writes while the process has not exited
    poller.register(pidfd, select.POLLIN)
    return bad + len(poller.poll(0))


class CoreContender:
    """``Daemon.bind_request`` in this process: the daemon's work with no socket; the
    release before each bind is not timed."""

    def __init__(self, tmp: str, *, name: str = "core-state", write_state: bool = True) -> None:
        cfg = Config(small_pool="share", state_dir=f"{tmp}/{name}",
                     npu_smi=os.path.join(FIXTURE_BIN, "npu-smi"))
        self.daemon = Daemon(cfg)
        if not write_state:  # both writes of a bind: its in-flight record and its final one
            self.daemon.runner.commit = lambda **kwargs: None  # the final write (and isolation's follow-up)
            self.daemon._save_in_flight = lambda binding: None
        self.root = Peer(os.getpid(), 0, 0)
        self.bound = False

    def __call__(self, pid: int) -> float:
        if self.bound:
            self.daemon.release_pid(pid)
        t0, c0 = time.perf_counter(), time.thread_time()
        self.daemon.bind_request(self.root, {"pid": pid, "npu": 0})
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
        self.bound = True
        return elapsed, cpu

    def close(self, pid: int) -> None:
        if self.bound:
            self.daemon.release_pid(pid)
            self.bound = False


def reconcile_per_thread(workers: int, threads: int) -> dict | None:
    """bench/reconcile_pass.py's cached look over ``workers`` x ``threads``, back to back."""
    from bench.reconcile_pass import measure

    if workers < 1:
        return None
    return measure(workers, threads, 6, 0.0)


class DaemonContender:
    """Bind through a real daemon; the release before each bind is not timed."""

    def __init__(self, tmp: str) -> None:
        env = base_env(f"{tmp}/s.sock", f"{tmp}/state", free_port(), ASCENDBIND_RECONCILE_SECONDS="5")
        self.proc = DaemonProc(tmp, env).start()
        self.proc.wait_discovered()
        self.bound = False

    def __call__(self, pid: int) -> float:
        if self.bound:
            self.proc.client.release(pid=pid)
        s0 = self.server_cpu()
        t0, c0 = time.perf_counter(), time.thread_time()
        self.proc.client.bind(pid=pid, npu=0)
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
        self.bound = True
        # the client's CPU and the daemon's (every thread of it: the HTTP loop, the worker)
        return elapsed, cpu + self.server_cpu() - s0

    def server_cpu(self) -> float:
        """Seconds of CPU the daemon's threads have run (schedstat, nanoseconds)."""
        total = 0
        base = f"/proc/{self.proc.proc.pid}/task"
        for tid in os.listdir(base):
            try:
                with open(f"{base}/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return total / 1e9

    def server_totals(self) -> tuple[float, float]:
        """(count, sum) of the daemon's own ascendbind_bind_duration_seconds."""
        text = self.proc.metrics_text()
        return (metric_value(text, "ascendbind_bind_duration_seconds_count") or 0.0,
                metric_value(text, "ascendbind_bind_duration_seconds_sum") or 0.0)

    def server_phases(self) -> dict[str, float]:
        """Seconds the daemon's binds spent so far in each phase (ascendbind_bind_phase_seconds_total)."""
        text = self.proc.metrics_text()
        return {p: metric_value(text, "ascendbind_bind_phase_seconds_total", phase=p) or 0.0 for p in BIND_PHASES}

    def close(self, pid: int) -> None:
        if self.bound:
            self.proc.client.release(pid=pid)
        self.proc.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50, help="rounds (each contender once per round); >= 50 for the ratios")
    ap.add_argument("--threads", type=int, default=200)
    ap.add_argument("--no-daemon", action="store_true", help="leave out the daemon contender")
    ap.add_argument("--reconcile-workers", type=int, default=2,
                    help="workers for the reconcile-pass figure (0: leave it out)")
    ap.add_argument("--json", help="also write the results as JSON to this path ('-': stdout)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.threads < 10:
        ap.error("need --runs >= 1 and --threads >= 10")

    os.environ["PATH"] = f"{FIXTURE_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.pop("ASCENDBIND_FIXTURE_HOST", None)
    floor_dir = tempfile.mkdtemp(prefix="ascendbind-bench-")
    true_exe = shutil.which("true")
    assert true_exe, "no `true` on PATH"
    floor_npu_smi = os.path.join(floor_dir, "npu-smi")
    os.symlink(true_exe, floor_npu_smi)
    daemon = None if args.no_daemon else DaemonContender(floor_dir)
    core = CoreContender(floor_dir)
    no_state = CoreContender(floor_dir, name="no-state", write_state=False)
    # the structured log of an in-process daemon would flood the terminal
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    # the main thread and the helper's idle "churner" count too; 4 acl + 4 release, the rest plain
    try:
        with start_worker(plain=args.threads - 10, acl=4, release=4) as live:
            pid = live.pid
            config = Config(small_pool="share")
            source = LiveHost.from_config(config)
            host = discover_host(source, config)
            worker = discover_worker(source, pid, config)
            plan = make_plan(host, worker, [0], config)
            if plan.errors:
                print("no plan:", plan.errors, file=sys.stderr)
                return 3
            npu = plan.npus[0]
            m, a, r = frozenset(npu.main), frozenset(npu.acl), frozenset(npu.release)
            n_threads = len(os.listdir(f"/proc/{pid}/task"))
            fake = os.path.join(FIXTURE_BIN, "npu-smi")
            pin = open_pin(pid)
            assert pin is not None, "no pidfd on this kernel"

            # a contender returns None (timed from outside), its own elapsed seconds, or (elapsed, CPU)
            contenders = {
                "reference": lambda: reference(pid, list(npu.main), list(npu.acl), list(npu.release), fake),
                "reference-floor": lambda: reference(pid, list(npu.main), list(npu.acl), list(npu.release),
                                                     floor_npu_smi),
                "apply_plan": lambda: apply_plan(plan, worker, host, config),
                "bind_threads": lambda: bind_threads(pid, npu, plan.mode, pin=pin),
                "bare": lambda: bare(pid, m, a, r, pin.fileno()),
            }
            contenders["daemon-core"] = lambda: core(pid)
            contenders["core-no-state"] = lambda: no_state(pid)
            if daemon is not None:
                contenders["daemon"] = lambda: daemon(pid)
                contenders["round-trip"] = lambda: daemon.proc.client.health()
            # warm-up: imports, page cache, first-touch of /proc entries
            for fn in contenders.values():
                fn()
            res = bind_threads(pid, npu, plan.mode, pin=pin)
            assert res.outcome.value == "applied" and res.data["bound"] == n_threads, res.detail

            times: dict[str, list[float]] = {k: [] for k in contenders}
            # CPU per call: this thread's, plus the daemon's own for the socket bind; unlike the
            # wall clock it does not count the time a loaded box keeps the binder waiting to run
            cpus: dict[str, list[float]] = {k: [] for k in contenders}
            names = list(contenders)
            server0 = daemon.server_totals() if daemon is not None else (0.0, 0.0)
            phases0 = daemon.server_phases() if daemon is not None else {}
            for i in range(args.runs):
                order = names[i % len(names):] + names[: i % len(names)]  # rotate who goes first
                for name in order:
                    t0 = time.perf_counter()
                    c0 = time.thread_time()
                    own = contenders[name]()
                    spent, cpu = time.perf_counter() - t0, time.thread_time() - c0
                    if isinstance(own, tuple):
                        spent, cpu = own
                    elif isinstance(own, float):
                        spent = own
                    times[name].append(spent)
                    cpus[name].append(cpu)
            core.close(pid)
            pin.close()
            no_state.close(pid)
            server_ms = None
            phases_ms: dict[str, float] = {}
            if daemon is not None:
                n, total = (b - a for a, b in zip(server0, daemon.server_totals()))
                server_ms = total / n * 1e3 if n else None
                phases_ms = {p: (v - phases0[p]) / n * 1e3 for p, v in daemon.server_phases().items()} if n else {}
                daemon.close(pid)
                daemon = None
    finally:
        if daemon is not None:
            daemon.proc.stop()
        core.daemon.hosts.close()
        no_state.daemon.hosts.close()
        shutil.rmtree(floor_dir, ignore_errors=True)
    reconcile = reconcile_per_thread(args.reconcile_workers, args.threads)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpus.items()}
    print(f"worker: {n_threads} threads (4 acl, 4 release); {args.runs} alternated runs each; CPUs {os.cpu_count()}")
    in_cpu = ("bare", "bind_threads", "apply_plan", "daemon-core", "core-no-state", "daemon")
    for k, v in med.items():
        cpu = f"   CPU {cpu_med[k] * 1e3:7.3f} ms" if k in in_cpu else ""
        print(f"  {k:<16} median {v * 1e3:9.3f} ms   (min {min(times[k]) * 1e3:.3f}, max {max(times[k]) * 1e3:.3f})"
              f"{cpu}")
    r_ref = med["reference"] / med["apply_plan"]
    r_floor = med["reference-floor"] / med["apply_plan"]
    r_bare = med["bind_threads"] / med["bare"]
    r_apply_bare = med["apply_plan"] / med["bare"]
    print(f"reference / apply_plan       = {r_ref:7.1f}x faster   (goal >= 10x: {'met' if r_ref >= 10 else 'MISSED'})")
    print(f"reference-floor / apply_plan = {r_floor:7.1f}x faster   (goal >= 10x: {'met' if r_floor >= 10 else 'MISSED'})")
    print(f"bind_threads / bare          = {r_bare:7.2f}x          (goal <= 1.5x: {'met' if r_bare <= 1.5 else 'MISSED'})")
    print(f"apply_plan / bare            = {r_apply_bare:7.2f}x          (all four steps vs the bare affinity loop)")
    r_core = med["daemon-core"] / med["bare"]
    print(f"daemon-core / bare           = {r_core:7.2f}x          (the daemon's bind in-process, state file included)")
    print(f"core-no-state / bare         = {med['core-no-state'] / med['bare']:7.2f}x          "
          f"(diagnostic: the same without the state file; the file costs "
          f"{(med['daemon-core'] - med['core-no-state']) * 1e3:.3f} ms a bind)")
    if "daemon" in med:
        r_daemon = med["daemon"] / med["bare"]
        r_ref_daemon = med["reference"] / med["daemon"]
        print(f"daemon / bare                = {r_daemon:7.2f}x          "
              f"(POST /v1/bind end to end vs the in-process floor; goal <= 1.5x: "
              f"{'met' if r_daemon <= 1.5 else 'MISSED'})")
        print(f"reference / daemon           = {r_ref_daemon:7.1f}x faster   "
              f"(goal >= 10x: {'met' if r_ref_daemon >= 10 else 'MISSED'})")
        print(f"socket + HTTP + client       = {(cpu_med['daemon'] - cpu_med['daemon-core']) * 1e3:7.3f} ms CPU per bind "
              f"(daemon - daemon-core); a no-op request's round trip {med['round-trip'] * 1e3:.3f} ms")
        least = med["bind_threads"] + med["round-trip"]
        print(f"(bind_threads + round-trip) / bare = {least / med['bare']:5.2f}x    (the floor's work in ascendbind's "
              f"code plus an empty request, {least * 1e3:.3f} ms: no bind over the socket costs less)")
    if server_ms is not None:
        print(f"daemon: {server_ms:.2f} ms mean inside the daemon per bind (ascendbind_bind_duration_seconds: "
              f"observation, plan, the four steps, the state file); the rest is socket, HTTP and client")
    if phases_ms:
        whole = sum(phases_ms.values())
        print(f"the daemon's bind by phase (mean ms per bind over {args.runs} binds, from accept to the answer "
              f"sent: {whole:.3f} ms; the client's side and the socket's transit are the rest of the median):")
        for phase, ms in phases_ms.items():
            print(f"  {phase:<9} {ms:7.3f} ms  {ms / whole * 100 if whole else 0:5.1f} %")
    if "daemon" in cpu_med:
        r_cpu = cpu_med["daemon"] / cpu_med["bare"]
        print(f"daemon CPU / bare CPU        = {r_cpu:7.2f}x          (client and daemon CPU per bind, "
              f"which a loaded box does not inflate; goal <= 1.5x: {'met' if r_cpu <= 1.5 else 'MISSED'})")
        print(f"daemon-core CPU / bare CPU   = {cpu_med['daemon-core'] / cpu_med['bare']:7.2f}x          "
              f"core-no-state CPU / bare CPU = {cpu_med['core-no-state'] / cpu_med['bare']:.2f}x")
    if reconcile is not None:
        print(f"reconcile pass: {reconcile['cached_us_per_thread']:.2f} us CPU per thread "
              f"({reconcile['workers']} x {reconcile['threads_per_worker']} threads, back to back; "
              f"a bind costs {med.get('daemon', med['daemon-core']) * 1e6 / n_threads:.2f} us per thread)")
    write_json(args.json, {
        "bench": "bind",
        "params": {"runs": args.runs, "threads": n_threads},
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "median_cpu_ms": {k: v * 1e3 for k, v in cpu_med.items()},
        "times_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
        "daemon_server_mean_ms": server_ms,
        "daemon_phase_mean_ms": phases_ms,
        "reconcile": reconcile,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
