"""A process's identity, read once and carried: the stat parser (PF_KTHREAD),
the never-a-worker rule on real processes of this host (pid 1, kthreadd, a
ksoftirqd, this process and its threads), the NPU claim rule as a table, and a
stale identity through discovery and the daemon core (409 ``pid_recycled``,
nothing changed)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

import pytest

from ascendbind.applier import apply_plan
from ascendbind.discovery.gather.identity import require_identity, require_worker
from ascendbind.discovery.gather.process import read_identity
from ascendbind.values.frozen import frozen_map
from ascendbind.settings import load_config
from ascendbind.daemon.api.auth import Peer, authorize
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.api.requests import claim_npus, evictable, outcome_of_error
from ascendbind.discovery import LiveHost, discover_worker
from ascendbind.discovery.parse.procfs import PF_KTHREAD, parse_stat
from ascendbind.errors import Conflict, NotPermitted, ParseError, ProcessGone
from ascendbind.values.model import DeviceType, Mode, Plan, WorkerFacts
from tests.daemon_harness import FIXTURE_BIN
from tests.planner_hosts import one_npu_host
from tests.workers import cpus_allowed_of, small_pool_plan, start_worker

STAT_TAIL = " ".join(str(n) for n in range(10, 49))  # fields 10..48, any numbers


def stat_line(pid=4242, comm="worker", state="S", ppid=1, flags=0x400000, start=987654):
    # fields 3..9, then 10..21, then 22 (starttime), then the rest
    tail = STAT_TAIL.split()
    return (f"{pid} ({comm}) {state} {ppid} {pid} {pid} 0 -1 {flags} " + " ".join(tail[:12])
            + f" {start} " + " ".join(tail[13:]) + "\n")


def kernel_threads() -> dict[int, str]:
    """pid -> comm of every kernel thread visible here, found by PF_KTHREAD."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ident = read_identity(int(name))
            if ident is not None and ident.is_kthread:
                out[ident.pid] = ident.comm
    return out


# ---------------------------------------------------------------- the pure parser


def test_stat_flags_say_kernel_thread_whatever_the_name():
    st = parse_stat(stat_line(comm="kworker/0:1", flags=0x04208040))
    assert st.is_kthread and st.flags & PF_KTHREAD and st.ppid == 1 and st.start_time == 987654
    # a user process may call itself anything, brackets and all
    fake = parse_stat(stat_line(comm="ksoftirqd/0) S 2 (x", flags=0x00400100))
    assert not fake.is_kthread and fake.comm == "ksoftirqd/0) S 2 (x" and fake.state == "S"


def test_stat_with_bad_flags_names_the_source():
    bad = stat_line().replace(" 4194304 ", " lots ")
    with pytest.raises(ParseError, match=r"/proc/4242/stat line 1: flags 'lots' is not a number"):
        parse_stat(bad, "/proc/4242/stat")
    with pytest.raises(ParseError, match="no '\\(comm\\)' field"):
        parse_stat("4242 worker S 1\n", "/proc/4242/stat")


# ---------------------------------------------------------------- real processes of this host


def test_init_kthreadd_ksoftirqd_and_ourselves_are_never_workers():
    me = require_identity(os.getpid())
    assert not me.is_kthread and me.uids[:3] == (0, 0, 0) and me.ppid == os.getppid()

    init = require_identity(1)
    assert init.not_a_worker(os.getpid()) == "pid 1 is init (pid 1) of this pid namespace"

    kthreads = kernel_threads()
    assert kthreads.get(2) == "kthreadd", kthreads
    soft = next(p for p, c in kthreads.items() if c.startswith("ksoftirqd/"))
    for pid in (2, soft):
        with pytest.raises(NotPermitted, match="is a kernel thread") as exc:
            require_worker(pid)
        assert exc.value.code == "not_a_worker" and exc.value.exit_status == 7

    with pytest.raises(NotPermitted, match="ascendbind itself"):
        require_worker(os.getpid())
    # one of our own threads, named by its tid, is still us
    ready, stop = threading.Event(), threading.Event()
    tids = []

    def run():
        tids.append(threading.get_native_id())
        ready.set()
        stop.wait()

    t = threading.Thread(target=run)
    t.start()
    try:
        ready.wait()
        ident = require_identity(tids[0])
        assert ident.tgid == os.getpid() and ident.pid != os.getpid()
        with pytest.raises(NotPermitted, match="ascendbind itself"):
            require_worker(tids[0])
    finally:
        stop.set()
        t.join()


def test_a_zombie_has_no_identity_to_bind():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # not reaped yet: wait for the zombie state without reaping it
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        with pytest.raises(ProcessGone, match="zombie"):
            require_identity(child.pid)
    finally:
        child.wait()
    assert read_identity(child.pid) is None


# ---------------------------------------------------------------- authorization decides on the identity given


def test_authorize_refuses_non_workers_even_for_root_and_release_skips_that_rule():
    root = Peer(os.getpid(), 0, 0)
    kthreadd = require_identity(2)
    with pytest.raises(NotPermitted) as exc:
        authorize(root, kthreadd, daemon_pid=0)
    assert exc.value.code == "not_a_worker"
    with pytest.raises(NotPermitted, match="ascendbind itself"):
        authorize(root, require_identity(os.getpid()), daemon_pid=os.getpid())
    authorize(root, kthreadd, daemon_pid=0, binding=False)  # undoing is allowed


def test_authorize_uses_the_identity_read_for_the_request_not_a_fresh_look(nobody_prefix):
    # a uid-65534 process and its parent: authorized as its own; the same pid
    # with an identity saying root owns it is refused, whatever /proc says now
    proc = subprocess.Popen([*nobody_prefix, sys.executable, "-c", "import sys; print('ready', flush=True); "
                             "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"  # past setpriv: running as 65534 now
        ident = require_identity(proc.pid)
        assert ident.uids[:3] == (65534, 65534, 65534)
        me = Peer(proc.pid, 65534, 65534)
        authorize(me, ident, daemon_pid=0)
        with pytest.raises(NotPermitted, match="does not belong to uid 65534"):
            authorize(me, dataclasses.replace(ident, uids=(0, 0, 0, 0)), daemon_pid=0)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


# ---------------------------------------------------------------- who gives way on an NPU


@pytest.mark.parametrize(
    ("holders", "listed", "expect"),
    [
        # an unlisted live holder gives way to a listed newcomer
        ([(7, (0,), True)], {(0, 9)}, ([], [7])),
        # a dead holder is replaced whatever the table says
        ([(7, (0,), False)], set(), ([7], [])),
        # no table: never evict
        ([(7, (0,), True)], None, "npu_busy"),
        # the holder is listed: it stays
        ([(7, (0,), True)], {(0, 9), (0, 7)}, "npu_busy"),
        # the newcomer is not listed either: first come keeps it
        ([(7, (0,), True)], {(1, 9)}, "npu_busy"),
        # listed on NPU 1 only, the newcomer cannot take the NPU 0 the holder also holds
        ([(7, (0, 1), True)], {(1, 9)}, "npu_busy"),
        # the holder listed on another NPU than the contested one still gives that one up
        ([(7, (0,), True)], {(0, 9), (1, 7)}, ([], [7])),
        # a holder on another NPU is not touched
        ([(7, (1,), True)], {(0, 9)}, ([], [])),
    ],
)
def test_claim_table(holders, listed, expect):
    listed = frozenset(listed) if listed is not None else None
    if expect == "npu_busy":
        with pytest.raises(Conflict) as exc:
            claim_npus(9, (0,), holders, listed)
        assert exc.value.code == "npu_busy" and "live worker 7" in str(exc.value)
    else:
        assert claim_npus(9, (0,), holders, listed) == expect


def test_shared_npus_allowed_means_nobody_is_evicted_or_refused():
    assert claim_npus(9, (0,), [(7, (0,), True)], frozenset({(0, 9)}), allow_shared=True) == ([], [])
    assert not evictable(9, 7, (), frozenset({(0, 9)}))  # nothing shared: nothing to give


def test_a_recycled_pid_counts_as_a_rejected_request():
    assert outcome_of_error(Conflict("x", code="pid_recycled")) == "rejected"
    assert outcome_of_error(Conflict("x", code="npu_busy")) == "failed"


# ---------------------------------------------------------------- a stale identity on the way


def _daemon(tmp_path) -> Daemon:
    cfg = load_config(None, env={}, overrides={"small_pool": "share"}).replace(
        state_dir=str(tmp_path / "state"), npu_smi=str(FIXTURE_BIN / "npu-smi"))
    return Daemon(cfg)


def test_discovery_refuses_facts_of_another_process_than_the_identity():
    with start_worker(plain=1) as w:
        ident = require_identity(w.pid)
        cfg = load_config(None, env={})
        assert discover_worker(LiveHost(), w.pid, cfg, identity=ident).start_time == ident.start_time
        with pytest.raises(ProcessGone) as exc:
            discover_worker(LiveHost(), w.pid, cfg, identity=dataclasses.replace(ident, start_time=ident.start_time - 1))
        assert exc.value.code == "pid_recycled"


def test_bind_with_a_stale_identity_is_409_pid_recycled_and_changes_nothing(tmp_path):
    d = _daemon(tmp_path)
    with start_worker(plain=1, acl=1, release=1) as w:
        before = w.cpus_allowed()
        stale = dataclasses.replace(require_identity(w.pid), start_time=w.start_time - 1)
        with pytest.raises(Conflict) as exc:
            d.bind_process(stale, (0,), None)
        assert exc.value.code == "pid_recycled" and exc.value.exit_status == 9
        assert w.cpus_allowed() == before and d.held == {}
        # the same request with the identity as it is binds
        result = d.bind_process(require_identity(w.pid), (0,), None)
        assert result["pid"] == w.pid and w.pid in d.held
        d.release_pid(w.pid)
        assert w.cpus_allowed() == before


def test_bind_of_a_non_worker_through_the_core_is_refused_before_discovery(tmp_path):
    d = _daemon(tmp_path)
    with pytest.raises(NotPermitted) as exc:
        d.bind_process(require_identity(2), (0,), None)
    assert exc.value.code == "not_a_worker" and d.held == {}


def _cpus_allowed(pid: int) -> dict[int, frozenset[int]]:
    return {int(tid): cpus_allowed_of(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def restore_cpus_allowed(pid: int, before: dict[int, frozenset[int]]) -> None:
    """Put back what a regression might have changed on a host process (leave the host as found)."""
    for tid, cpus in before.items():
        if cpus and cpus_allowed_of(pid, tid) not in (None, cpus):
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass


@pytest.mark.parametrize("who", ["init", "kthreadd", "self"])
def test_applier_refuses_init_kthreadd_and_itself_whoever_calls_it(who):
    pid = {"init": 1, "kthreadd": 2, "self": os.getpid()}[who]
    cpus = frozenset(os.sched_getaffinity(0))
    plan = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, tuple(sorted(cpus)), (small_pool_plan(sorted(cpus)),))
    host = one_npu_host({0: cpus}, affinity={0: cpus})
    worker = WorkerFacts(pid, require_identity(pid).start_time, cpus, "status", frozenset({0}), frozen_map())
    before = _cpus_allowed(pid)
    try:
        with pytest.raises(NotPermitted) as exc:
            apply_plan(plan, worker, host, load_config(None, env={}, overrides={"small_pool": "share"}))
        assert exc.value.code == "not_a_worker"
        assert _cpus_allowed(pid) == before
    finally:
        restore_cpus_allowed(pid, before)


def test_a_state_entry_for_a_kernel_thread_is_released_at_restore_never_kept(tmp_path):
    # a state file written by a daemon that did not refuse kthreadd, next to a real worker's entry
    from ascendbind.daemon.state.state import StateFile
    from ascendbind.daemon.state.staterecord import binding_to_json
    from tests.test_daemon_parts import BINDING

    before = _cpus_allowed(2)
    with start_worker(plain=1) as w:
        entries = [
            dataclasses.replace(BINDING, pid=pid, start_time=require_identity(pid).start_time,
                                original_cpus=cpus, saved_irq_masks=frozen_map())
            for pid, cpus in ((2, before[2]), (w.pid, frozenset(os.sched_getaffinity(0))))
        ]
        StateFile(str(tmp_path / "state")).save([binding_to_json(b) for b in entries])
        d = _daemon(tmp_path)
        try:
            assert d.restore()["kept"] == 1
            assert sorted(d.held) == [w.pid]
            assert _cpus_allowed(2) == before
            assert 'ascendbind_workers_dropped_total{reason="released"} 1.0' in d.metrics.render().decode()
        finally:
            restore_cpus_allowed(2, before)
