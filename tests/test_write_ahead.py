"""A bind is in the state file before its first write: kill -9 of a real daemon while it
binds a real ~300-thread worker leaves that worker either held (and ``release`` puts it
back) or back on its original CPUs after a restart, never pinned without a record.

The daemon is stopped at a chosen point of the bind by the test-only variable
``ASCENDBIND_TEST_STOP_AT`` (it sends itself SIGSTOP there) and killed while stopped, so
the kill lands exactly in the window: after the in-flight record and before the first
task mask (``record``), or after every task mask and before the IRQ masks (``irq``). A
loop of kills at random moments of the writes (continued from the record, killed after
a random delay) checks the same outcome wherever the kill lands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ascendbind.applier.irq import set_irq_affinity
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.host.replan import replan_worker
from ascendbind.daemon.state.staterecord import binding_from_json, binding_to_json
from ascendbind.discovery.gather.process import read_identity
from ascendbind.settings import load_config
from ascendbind.values.config import Config
from ascendbind.values.reasons import Step
from ascendbind.discovery.gather.irqhost import read_irq_mask
from ascendbind.values.cpulist import format_cpulist, parse_cpulist, parse_mask
from tests.daemon_harness import FIXTURE_BIN, PATIENCE, DaemonProc, base_env, free_port, metric_value, wait_for
from tests.irqbalance_harness import irq_masks_lock, restore_irq_masks as put_back_irq_masks
from tests.test_daemon_irq_ownership import _binding, _proc_tree
from tests.workers import Worker, start_worker

CPUS = frozenset(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="a binding on one CPU changes no mask")

PLAIN = 297  # + acl_thread, release_thread, the child's churner and its main thread: 301 threads
THREADS = PLAIN + 4
KILLS = 30


def _daemon(tmp_path: Path, stop_at: str = "", port: int | None = None) -> DaemonProc:
    env = base_env(str(tmp_path / "ascendbind.sock"), str(tmp_path / "state"), port or free_port(),
                   ASCENDBIND_TEST_STOP_AT=stop_at)
    return DaemonProc(str(tmp_path), env)


def _started(d: DaemonProc) -> DaemonProc:
    """``d`` serving, its host discovered: a restart over a 301-thread worker competes with that
    worker's first look and, in the stress runs, with busy loops on every CPU, so the waits are long."""
    d.start(wait=False)
    try:
        d.wait_ready(60 * PATIENCE)
        d.wait_discovered(60 * PATIENCE)
    except BaseException:
        d.stop()  # never left running behind a failed test
        raise
    return d


def _stopped(pid: int) -> bool:
    """The process stopped itself (state T), where ASCENDBIND_TEST_STOP_AT said."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()[0] == "T"


def _state(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "state" / "state.json").read_text())


def _records(tmp_path: Path, pid: int) -> list[dict]:
    return [w for w in _state(tmp_path)["workers"] if w["pid"] == pid]


@contextlib.contextmanager
def _bind_in_background(d: DaemonProc, pid: int) -> Iterator[subprocess.Popen]:
    """A bind request that may never be answered (its daemon dies): curl, reaped on the way out."""
    proc = subprocess.Popen(["curl", "-sS", "--max-time", str(60 * PATIENCE), "--unix-socket", d.sock,
                             "-X", "POST", "-H", "Content-Type: application/json",
                             "--data-binary", json.dumps({"pid": pid, "npu": 0}), "http://localhost/v1/bind"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _masks(w: Worker) -> Counter:
    """How many of the worker's threads sit on each mask."""
    return Counter(frozenset(m) for m in w.cpus_allowed().values())


def _kill(d: DaemonProc) -> None:
    os.kill(d.pid, signal.SIGKILL)
    d.stop()  # reaps it and closes its log


def _after_restart(d: DaemonProc, w: Worker) -> str:
    """The restarted daemon's word on ``w``: ``held`` (and then released: every thread back
    on the original CPUs) or ``undone`` (every thread on the original CPUs already)."""
    held = [x["pid"] for x in d.client.workers()["workers"]]
    if w.pid in held:
        d.client.release(w.pid)
        assert _masks(w) == Counter({CPUS: len(w.threads())}), "release did not restore every thread"
        return "held"
    masks = _masks(w)
    assert masks == Counter({CPUS: sum(masks.values())}), \
        f"worker {w.pid} is pinned and its restarted daemon holds no record of it: {dict(masks)}\n{d.log()[-3000:]}"
    return "undone"


@pytest.mark.parametrize("point", ["record", "irq"])
def test_kill_9_at_a_point_of_the_bind_is_undone_at_restart(tmp_path, point):
    with start_worker(plain=PLAIN, acl=1, release=1) as w:
        assert len(w.threads()) == THREADS
        d = _started(_daemon(tmp_path, point))
        try:
            with _bind_in_background(d, w.pid):
                assert wait_for(lambda: _stopped(d.pid), 30 * PATIENCE), d.log()[-3000:]
                # stopped: the bind is in the file, in flight, with what undoing it needs
                [rec] = _records(tmp_path, w.pid)
                assert rec["in_flight"] is True and rec["original_cpus"] == format_cpulist(CPUS)
                assert rec["steps"] == [] and rec["plan"]["npus"]["0"]["main"]
                masks = _masks(w)
                if point == "record":  # nothing written yet
                    assert masks == Counter({CPUS: THREADS}), masks
                else:  # every task mask written, the IRQ masks not yet
                    assert CPUS not in masks and sum(masks.values()) == THREADS, masks
                _kill(d)
        finally:
            d.stop()
        d2 = _started(_daemon(tmp_path))
        try:
            assert _after_restart(d2, w) == "undone"
            assert metric_value(d2.metrics_text(), "ascendbind_workers_dropped_total", reason="interrupted") == 1
            assert "bind in flight undone" in d2.log()
            assert _records(tmp_path, w.pid) == []  # the in-flight record left the file
            # and the worker binds as before
            status, body = d2.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
            assert status == 200, body
            [rec] = _records(tmp_path, w.pid)
            assert "in_flight" not in rec and CPUS not in _masks(w)
            d2.client.release(w.pid)
        finally:
            d2.stop()


def test_a_bind_that_ends_leaves_no_in_flight_record(tmp_path):
    with start_worker(plain=3) as w, contextlib.ExitStack() as stack:
        d = _started(_daemon(tmp_path))
        stack.callback(d.stop)
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, body
        [rec] = _records(tmp_path, w.pid)
        assert "in_flight" not in rec and rec["steps"]
        d.client.release(w.pid)


def test_kill_9_at_random_moments_of_binds_never_leaves_a_worker_pinned_without_a_record(tmp_path):
    rng = random.Random(os.environ.get("WRITE_AHEAD_SEED") or None)
    outcomes: Counter = Counter()
    at_kill: Counter = Counter()
    port = free_port()
    with start_worker(plain=PLAIN, acl=1, release=1) as w:
        span = _bind_duration(tmp_path / "calibrate", w)
        d = _started(_daemon(tmp_path, "record", port))
        try:
            for _ in range(KILLS):
                with _bind_in_background(d, w.pid):
                    assert wait_for(lambda: _stopped(d.pid), 30 * PATIENCE), d.log()[-3000:]
                    os.kill(d.pid, signal.SIGCONT)
                    # the moment of the kill, drawn at random over the bind's writes: this chooses
                    # when to kill, it waits for nothing
                    threading.Event().wait(rng.uniform(0, span))
                    _kill(d)
                at_kill[_where(tmp_path, w)] += 1
                d = _started(_daemon(tmp_path, "record", port))  # the next kill's daemon restarts it
                outcomes[_after_restart(d, w)] += 1
        finally:
            d.stop()
    print(f"\n{KILLS} kills over {span * 1000:.1f} ms binds of {THREADS} threads: at the kill {dict(at_kill)}; "
          f"after restart {dict(outcomes)}; 0 pinned without a record")
    assert sum(outcomes.values()) == KILLS
    assert at_kill["in flight, some masks written"] + at_kill["in flight, all masks written"] >= 1, at_kill


def _bind_duration(directory: Path, w: Worker) -> float:
    """Seconds from a bind's record to its answer here: the span the kills are spread over."""
    directory.mkdir()
    d = _started(_daemon(directory))
    try:
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, body
        d.client.release(w.pid)
        text = d.metrics_text()
        total = metric_value(text, "ascendbind_bind_duration_seconds_sum")
        return max(total or 0.0, 0.005)
    finally:
        d.stop()


def _where(tmp_path: Path, w: Worker) -> str:
    """Where the kill landed: the worker's record in the file and how many threads were pinned."""
    records = _records(tmp_path, w.pid)
    masks = _masks(w)
    pinned = sum(n for m, n in masks.items() if m != CPUS)
    if not records:
        return "no record, nothing written" if not pinned else "no record, masks written"
    if records[0].get("in_flight"):
        if not pinned:
            return "in flight, nothing written"
        return "in flight, all masks written" if pinned == sum(masks.values()) else "in flight, some masks written"
    return "held"


# ---------------------------------------------------------------- the IRQ masks, on this machine's /proc/irq

NPU_PCI = "0000:c1:00.0"  # where the fixture npu-smi puts NPU 0: an address this machine lacks


def _changeable_irqs(n: int) -> list[int]:
    """``n`` IRQs of this machine that accept a write of their own mask (harmless)."""
    found = []
    for name in sorted(os.listdir("/proc/irq"), key=lambda x: int(x) if x.isdigit() else -1):
        if not name.isdigit():
            continue
        irq = int(name)
        original = read_irq_mask(irq)
        if original is None or set_irq_affinity(irq, parse_mask(original)).status != "ok":
            continue
        found.append(irq)
        if len(found) == n:
            return found
    pytest.skip(f"fewer than {n} IRQs of this machine accept a mask write")


def _npu_host(directory: Path, sq: int, cq: int) -> tuple[Path, Path]:
    """(sys_root, interrupts): NPU 0's MSI vectors are the real IRQs ``sq`` and ``cq``, named
    as the NPU driver names them; every other /sys path the daemon reads is this machine's."""
    sys_root = directory / "sys"
    msi = sys_root / "bus" / "pci" / "devices" / NPU_PCI / "msi_irqs"
    msi.mkdir(parents=True)
    for irq in (sq, cq):
        (msi / str(irq)).write_text("msix\n")
    (msi.parent / "numa_node").write_text("-1\n")
    for name in os.listdir("/sys"):
        if name != "bus":
            (sys_root / name).symlink_to(f"/sys/{name}")
    cpus = "".join(f"{'CPU' + str(c):>11}" for c in range(os.cpu_count() or 1))
    zeros = "".join(f"{0:>11}" for _ in range(os.cpu_count() or 1))
    interrupts = directory / "interrupts"
    interrupts.write_text(f"{cpus}\n{sq:>4}:{zeros}   ITS-MSI 1049600 Edge      sq_send_trigger_irq\n"
                          f"{cq:>4}:{zeros}   ITS-MSI 1049601 Edge      cq_update_irq\n")
    return sys_root, interrupts


def _irq_daemon(tmp_path: Path, sys_root: Path, interrupts: Path, stop_at: str = "") -> DaemonProc:
    """A daemon in a mount namespace of its own, where /proc/interrupts is ``interrupts``."""
    env = base_env(str(tmp_path / "ascendbind.sock"), str(tmp_path / "state"), free_port(),
                   ASCENDBIND_TEST_STOP_AT=stop_at, ASCENDBIND_SYS_ROOT=str(sys_root),
                   ASCENDBIND_IRQBALANCE="warn")  # never tell an irqbalance some other test runs
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /proc/interrupts && exec "$@"', str(interrupts),
            sys.executable, "-m", "ascendbind.cli", "serve"]
    return DaemonProc(str(tmp_path), env, argv)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/proc/irq", os.W_OK), reason="needs root and /proc/irq")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
@pytest.mark.parametrize("point", ["record", "irq", "written"])
def test_kill_9_around_the_irq_writes_gives_the_irqs_their_masks_back_at_restart(tmp_path, point):
    with irq_masks_lock():
        sq, cq = _changeable_irqs(2)
        originals = {irq: read_irq_mask(irq) for irq in (sq, cq)}
        try:
            _kill_around_irq_writes(tmp_path, point, sq, cq, originals)
        finally:
            put_back_irq_masks(originals)


def _kill_around_irq_writes(tmp_path: Path, point: str, sq: int, cq: int, originals: dict) -> None:
    sys_root, interrupts = _npu_host(tmp_path, sq, cq)
    with start_worker(plain=8, acl=1, release=1) as w:
        d = _started(_irq_daemon(tmp_path, sys_root, interrupts, point))
        try:
            with _bind_in_background(d, w.pid):
                assert wait_for(lambda: _stopped(d.pid), 30 * PATIENCE), d.log()[-3000:]
                [rec] = _records(tmp_path, w.pid)
                # the masks the bind will change are in its record before it writes any of them
                assert rec["in_flight"] is True
                assert rec["saved_irq_masks"] == {str(irq): m for irq, m in originals.items()}
                irq_cpus = frozenset(parse_cpulist(rec["plan"]["npus"]["0"]["irq"]))
                now = {irq: parse_mask(read_irq_mask(irq)) for irq in (sq, cq)}
                if point == "written":
                    assert now == {sq: irq_cpus, cq: irq_cpus}
                else:
                    assert now == {irq: parse_mask(m) for irq, m in originals.items()}
                _kill(d)
        finally:
            d.stop()
        d2 = _started(_irq_daemon(tmp_path, sys_root, interrupts))
        try:
            assert _after_restart(d2, w) == "undone"
            assert {irq: read_irq_mask(irq) for irq in (sq, cq)} == originals, d2.log()[-3000:]
            # the same daemon binds them for real: the step writes exactly those IRQs
            status, body = d2.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
            assert status == 200, body
            assert {irq: parse_mask(read_irq_mask(irq)) for irq in (sq, cq)} == {sq: irq_cpus, cq: irq_cpus}, body
            d2.client.release(w.pid)
            assert {irq: read_irq_mask(irq) for irq in (sq, cq)} == originals
        finally:
            d2.stop()


# ---------------------------------------------------------------- in process: a failed bind, the restart rules


def test_a_bind_that_fails_after_its_record_is_undone_at_once(tmp_path):
    def fail(_pid, step):
        if step is Step.IRQ:
            raise RuntimeError("stand-in for a fault among the writes")

    d = Daemon(Config(small_pool="share", state_dir=str(tmp_path / "state"), memory_check_seconds=0,
                      npu_smi=str(FIXTURE_BIN / "npu-smi")))
    d.among_writes = fail
    d.state.prepare()
    with start_worker(plain=20) as w:
        with pytest.raises(RuntimeError):
            d.bind_process(read_identity(w.pid, "/proc"), (0,), None)
        assert _masks(w) == Counter({CPUS: len(w.threads())})  # every written task mask put back
        assert d.held == {} and _records(tmp_path, w.pid) == []
        d.among_writes = None
        assert d.bind_process(read_identity(w.pid, "/proc"), (0,), None)["status"] == "bound"
        assert CPUS not in _masks(w)
        d.release_pid(w.pid)


def _fixture_daemon(tmp_path, proc) -> Daemon:
    cfg = load_config(None, env={}).replace(proc_root=str(proc), state_dir=str(tmp_path / "state"))
    return Daemon(cfg)


def test_restart_gives_back_the_irq_masks_of_a_bind_in_flight_whose_worker_is_gone(tmp_path):
    proc = _proc_tree(tmp_path, {120: "00000004", 121: "00000008"})
    d = _fixture_daemon(tmp_path, proc)
    d.state.prepare()
    d.state.save([binding_to_json(_binding(100, 0, 120, 121, saved=("000000ff", "0000ff00")), in_flight=True)])
    d2 = _fixture_daemon(tmp_path, proc)
    assert d2.restore()["gone"] == 1 and d2.held == {}
    assert (proc / "irq/120/smp_affinity").read_text().strip() == "000000ff"
    assert (proc / "irq/121/smp_affinity").read_text().strip() == "0000ff00"
    assert _state(tmp_path)["workers"] == []


def test_restart_leaves_the_irq_masks_of_an_npu_a_live_worker_holds(tmp_path):
    # pid 200 holds NPU 1 (live); the bind in flight of pid 100 on the same NPU dies with its daemon
    proc = _proc_tree(tmp_path, {130: "00000010", 131: "00000020"}, live_pids=[200])
    d = _fixture_daemon(tmp_path, proc)
    d.state.prepare()
    live = _binding(200, 1, 130, 131, cpus=(4, 5), saved=("000000ff", "000000ff"))
    flying = _binding(100, 1, 130, 131, cpus=(4, 5), saved=("000000ff", "000000ff"))
    d.state.save([binding_to_json(live), binding_to_json(flying, in_flight=True)])
    d2 = _fixture_daemon(tmp_path, proc)
    assert d2.restore()["kept"] == 1 and sorted(d2.held) == [200]
    assert (proc / "irq/130/smp_affinity").read_text().strip() == "00000010"  # the live owner's
    assert (proc / "irq/131/smp_affinity").read_text().strip() == "00000020"
    assert [w["pid"] for w in _state(tmp_path)["workers"]] == [200]


# ---------------------------------------------------------------- in process: a re-plan writes ahead too


def test_a_replan_is_in_the_state_file_before_its_first_write_and_a_restart_undoes_it(tmp_path):
    """A re-plan binds the worker again: the new binding, with the worker's first original CPUs,
    is an in-flight record before the first task mask is written. The state file as it stands
    among the writes is what a kill there leaves; a daemon started on it puts the worker back."""
    d = Daemon(Config(small_pool="share", state_dir=str(tmp_path / "state"), memory_check_seconds=0,
                      npu_smi=str(FIXTURE_BIN / "npu-smi")))
    d.state.prepare()
    left = tmp_path / "left"
    seen: list[tuple[Step, dict]] = []

    def among(pid, step):
        rec = _records(tmp_path, pid)
        seen.append((step, rec))
        if step is Step.IRQ and not left.exists():  # the task masks are written, the IRQ masks not yet
            shutil.copytree(tmp_path / "state", left)

    with start_worker(plain=20) as w:
        assert d.bind_process(read_identity(w.pid, "/proc"), (0,), None)["status"] == "bound"
        h = d.held[w.pid]
        bound = _masks(w)
        assert CPUS not in bound
        # as if it had been planned from another cpuset: the plan made now differs, so it is bound again
        narrower = (min(CPUS),)
        h.binding = dataclasses.replace(h.binding, plan=dataclasses.replace(h.binding.plan, allowed_cpus=narrower))
        d.among_writes = among
        assert replan_worker(d, h, d.hosts.get(), reason="host_changed").outcome == "rebound"
        d.among_writes = None
        [(step, [rec])] = [(s, r) for s, r in seen if s is Step.IRQ]
        planned = binding_from_json(rec)
        assert rec["in_flight"] is True and frozenset(planned.plan.allowed_cpus) == CPUS and planned.original_cpus == CPUS
        assert _records(tmp_path, w.pid)[0].get("in_flight") is not True  # the re-plan's own save replaced it
        assert _masks(w) == bound
        # the daemon killed there: the next one finds the record in flight and puts the worker back
        d2 = Daemon(Config(small_pool="share", state_dir=str(left), memory_check_seconds=0,
                           npu_smi=str(FIXTURE_BIN / "npu-smi")))
        d2.restore()
        assert d2.held == {} and _masks(w) == Counter({CPUS: len(w.threads())})
        assert [r for r in json.loads((left / "state.json").read_text())["workers"] if r["pid"] == w.pid] == []
        d.release_pid(w.pid)
