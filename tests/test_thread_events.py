"""The reconcile loop's thread events: the kernel's process events parsed from bytes,
the real connector socket and its filter, and the loop in both of its modes
(events, listing) on real workers, one pass at a time.

The loop tests drive ``Reconciler.pass_once`` themselves on a real ``Daemon``
holding a real worker bound by the real affinity step, so "within one pass" is
exact: a change made before a pass is acted upon by that pass, no sleeping. The
fallback by namespace runs a real ``ascendbind serve`` under ``unshare -n``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile

import pytest

from ascendbind.applier.affinity import bind_tasks
from ascendbind.discovery.gather.identity import start_time
from ascendbind.applier.irq import set_irq_affinity
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.watch.held import Held, SeenThread
from ascendbind.daemon.watch.observe import COMM_SWEEP_PASSES, role_cpus, sweep_slots
from ascendbind.daemon.watch.reconcile import Reconciler
from ascendbind.daemon.watch.threadevents import LOSS_LIMIT, ThreadEvents
from ascendbind.values.decisions import IrqBinding
from ascendbind.discovery.gather.irqhost import read_irq_mask
from ascendbind.discovery.read.proc_connector import ProcEventSocket
from ascendbind.discovery.parse.proc_events import (COMM, EXEC, EXIT, FORK, MAX_FILTER_TGIDS, NONE, ProcEvent, ack_error,
                                              listen_message, parse_events, process_start_filter, socket_filter,
                                              started_processes, thread_changes)
from ascendbind.errors import DiscoveryError
from ascendbind.values.cpulist import parse_mask
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import Binding, DeviceType, Mode, NpuPlan, Plan
from tests.audit import Reads
from tests.daemon_harness import ROOT, DaemonProc, base_env, metric_value, wait_for
from tests.irqbalance_harness import restore_irq_masks
from tests.workers import cpus_allowed_of, start_worker

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="roles only separate with 2+ CPUs")


# ---------------------------------------------------------------- bytes -> events


def datagram(what: int, *words: int, comm: bytes = b"", cn=(1, 1), ack: int = 0, pad_to: int = 24) -> bytes:
    """One message as the connector sends it: nlmsghdr, cn_msg, proc_event (40 bytes)."""
    data = struct.pack(f"={len(words)}I", *words) + comm
    event = struct.pack("=IIQ", what, 0, 123456789) + data.ljust(pad_to, b"\0")
    msg = struct.pack("=IIIIHH", cn[0], cn[1], 7, ack, len(event), 0) + event
    return struct.pack("=IHHII", 16 + len(msg), 3, 0, 7, 0) + msg


def test_each_kind_of_event_is_read_from_the_bytes_the_kernel_sends():
    assert parse_events(datagram(FORK, 10, 10, 4242, 4200)) == [ProcEvent("fork", tgid=4200, tid=4242)]
    assert parse_events(datagram(EXEC, 4200, 4200)) == [ProcEvent("exec", tgid=4200, tid=4200)]
    assert parse_events(datagram(COMM, 4242, 4200, comm=b"acl_thread\0junk!")) == \
        [ProcEvent("comm", tgid=4200, tid=4242, comm="acl_thread")]
    assert parse_events(datagram(COMM, 4242, 4200, comm=b"fifteen-bytes-x\0")) == \
        [ProcEvent("comm", tgid=4200, tid=4242, comm="fifteen-bytes-x")]
    assert parse_events(datagram(EXIT, 4242, 4200, 0, 17, 1, 1)) == [ProcEvent("exit", tgid=4200, tid=4242)]
    assert parse_events(datagram(NONE, errno.EPERM, ack=8)) == [ProcEvent("ack", err=errno.EPERM, ack=8)]
    assert parse_events(datagram(0x4, 4242, 4200)) == [ProcEvent("other", tgid=4200, tid=4242)]  # a uid change
    two = datagram(FORK, 1, 1, 4243, 4200) + datagram(EXIT, 4243, 4200)
    assert [e.kind for e in parse_events(two)] == ["fork", "exit"]


@pytest.mark.parametrize("data", [
    datagram(FORK, 1, 1, 4242, 4200)[:40],  # cut inside the event
    datagram(FORK, 1, 1, 4242, 4200, cn=(2, 1)),  # another connector's message
    datagram(COMM, 4242, 4200, pad_to=8),  # a rename without its name
    datagram(FORK, 1, 1, pad_to=8),  # a fork without its child
    struct.pack("=IHHII", 8, 3, 0, 0, 0) + b"\0" * 60,  # a length shorter than its own header
    struct.pack("=IHHII", 4096, 3, 0, 0, 0) + b"\0" * 60,  # a length past the datagram
], ids=["cut", "foreign", "comm-short", "fork-short", "len-short", "len-long"])
def test_a_truncated_or_foreign_message_is_none_never_an_error(data):
    assert parse_events(data) == [None]
    assert thread_changes(parse_events(data), {4200}).malformed == 1


def test_nothing_but_a_header_fragment_yields_nothing():
    assert parse_events(b"") == [] and parse_events(b"\0" * 15) == []


W, X = 4200, 5100  # a bound worker, a process nobody holds
CHANGES = [
    # (events, look, resync): an event says which thread to read again, never what it is now
    ([ProcEvent("fork", W, 4242)], {W: {4242}}, set()),
    ([ProcEvent("fork", W, 4242), ProcEvent("exit", W, 4242)], {W: {4242}}, set()),  # born and gone: read, forgotten
    ([ProcEvent("comm", W, 4242, "acl_thread"), ProcEvent("comm", W, 4243, "x")], {W: {4242, 4243}}, set()),
    ([ProcEvent("fork", X, 5101), ProcEvent("comm", X, 5101, "acl_thread")], {}, set()),  # not bound
    ([ProcEvent("fork", W, W)], {}, set()),  # a process whose pid is W's: not a thread of W
    ([ProcEvent("exec", W, W), ProcEvent("exit", W, 4242)], {W: {4242}}, {W}),
    ([ProcEvent("ack", err=0, ack=1), ProcEvent("other", W, 4242), None], {}, set()),
]


@pytest.mark.parametrize("events,look,resync", CHANGES)
def test_events_name_the_threads_to_read_again_and_only_bound_workers_count(events, look, resync):
    ch = thread_changes(events, {W})
    assert ch.look == {k: frozenset(v) for k, v in look.items()}
    assert ch.resync == frozenset(resync)
    assert ch.events == sum(1 for e in events if e is not None and e.tgid == W and e.kind not in ("ack", "other"))


def test_the_subscription_and_its_answer():
    msg = listen_message(1, 0xFFFFFFFF)
    assert len(msg) == 16 + 20 + 4 and struct.unpack_from("=I", msg)[0] == len(msg)
    assert struct.unpack_from("=IIIIHHI", msg, 16) == (1, 1, 0, 0xFFFFFFFF, 4, 0, 1)
    mine, theirs = datagram(NONE, 0, ack=0), datagram(NONE, errno.EPERM, ack=5)  # 0xFFFFFFFF + 1 wraps to 0
    assert ack_error(parse_events(theirs) + parse_events(mine), 0xFFFFFFFF) == 0
    assert ack_error(parse_events(theirs), 4) == errno.EPERM
    assert ack_error(parse_events(theirs), 0xFFFFFFFF) is None  # another listener's answer


def test_the_socket_filter_has_two_instructions_per_worker_and_a_ceiling():
    base = len(socket_filter([])) // 8
    assert len(socket_filter([1, 2, 3])) // 8 == base + 6
    assert len(socket_filter([3, 3, 3])) // 8 == base + 2  # duplicates tested once
    assert (base + 2 * MAX_FILTER_TGIDS) <= 4096  # the kernel's BPF_MAXINSNS
    assert socket_filter(range(MAX_FILTER_TGIDS + 1)) is None


# ---------------------------------------------------------------- the real socket


def _open_or_skip(**kw) -> ProcEventSocket:
    try:
        return ProcEventSocket.open(**kw)
    except DiscoveryError as exc:
        pytest.skip(f"no process events here: {exc}")


def _events(src: ProcEventSocket):
    datagrams, lost = src.read()
    return [e for d in datagrams for e in parse_events(d)], lost


def _events_until(src: ProcEventSocket, done, timeout: float = 10.0):
    """Read until ``done(events so far)``: a thread's exit event is sent after /proc
    stops listing it, so the caller waits for it rather than for the thread's end."""
    got: list = []
    lost = False

    def more() -> bool:
        nonlocal lost
        batch, lost_now = _events(src)
        got.extend(batch)
        lost = lost or lost_now
        return done(got)

    assert wait_for(more, timeout, interval=0.01), got
    return got, lost


def test_the_kernel_keeps_only_the_events_of_the_filtered_workers():
    src = _open_or_skip()
    try:
        with start_worker(plain=1, acl=0, release=0) as mine, start_worker(plain=1, acl=0, release=0) as other:
            assert src.set_filter([mine.pid]) and src.filtered
            _events(src)  # whatever came before
            tids = {}
            for w in (mine, other):
                tids[w.pid] = tid = w.spawn("worker_new")
                w.rename(tid, "acl_thread_7")
                w.stop(tid)
            t = tids[mine.pid]
            other_exit = ProcEvent("exit", other.pid, tids[other.pid])
            # the other worker's exit is sent after mine: once mine is in, the filter had its chance
            got, lost = _events_until(src, lambda evs: ProcEvent("exit", mine.pid, t) in evs)
            stop = other.spawn("worker_end")  # one more event each way, to flush what was in flight
            mine.spawn("worker_end")
            got += _events_until(src, lambda evs: any(e.kind == "fork" for e in evs))[0]
            assert not lost and other_exit not in got and stop not in {e.tid for e in got}
            assert {e.tgid for e in got} == {mine.pid}, got
            assert [(e.kind, e.tid) for e in got if e.kind != "comm"][:2] == [("fork", t), ("exit", t)]
            # named by the thread itself (prctl), then renamed through /proc: both carry the name
            assert [e.comm for e in got if e.kind == "comm"][:2] == ["worker_new", "acl_thread_7"]
            assert thread_changes(got, {mine.pid}).look[mine.pid] >= {t}
    finally:
        src.close()


def test_a_full_queue_is_reported_as_lost_events():
    src = _open_or_skip(buffer_bytes=4096)  # the kernel's floor: a handful of events
    try:
        with start_worker(plain=1, acl=0, release=0) as w:
            src.set_filter([w.pid])
            for _ in range(40):  # a fork and a rename each: far more than the queue holds
                w.spawn("worker_x")
            got, lost = _events(src)
            assert lost and len(got) < 80
            _, lost = _events(src)
            assert not lost  # reported once; the socket reads on
    finally:
        src.close()


PROBE = ("from ascendbind.discovery.read.proc_connector import ProcEventSocket\n"
         "from ascendbind.errors import DiscoveryError\n"
         "try:\n    ProcEventSocket.open().close(); print('events')\n"
         "except DiscoveryError as e:\n    print(e.code)\n")


# Each namespace, and every way a kernel is known to refuse the subscription from it. From
# another network namespace the connector's socket answers ECONNREFUSED. From a user
# namespace, 6.1 ignores the subscription (no answer: ``no_ack``) while 6.18 refuses it with
# EPERM (``permission``). Both are the kernel refusing; the test takes either and says which.
REFUSALS = {"network": (["-n"], {"namespace"}),
            "user": (["-U", "-r"], {"no_ack", "permission"})}


@pytest.mark.parametrize("namespace", sorted(REFUSALS))
def test_outside_the_hosts_namespaces_the_connector_says_why(namespace, record_property):
    flags, codes = REFUSALS[namespace]
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare missing")
    r = subprocess.run([unshare, *flags, sys.executable, "-c", PROBE], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=60)
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"unshare {' '.join(flags)} refused here: {r.stderr.strip()}")
    got = r.stdout.strip()
    assert got in codes, f"{got!r} not one of {sorted(codes)}: {r.stderr}"
    record_property("refusal", got)  # which of the kernel's answers this machine gave
    print(f"{namespace} namespace: this kernel ({os.uname().release}) refused with {got!r}")


# ---------------------------------------------------------------- the loop, one pass at a time


def _plan() -> Plan:
    cpus = tuple(CPUS)
    return Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, cpus,
                (NpuPlan(0, cpus, (), cpus[:-1], cpus[-1:], cpus[-1:], (0,)),))


def _bind(d: Daemon, pid: int) -> Held:
    """Bind ``pid`` as a bind request would (the real affinity step), and hold it."""
    plan = _plan()
    applied = bind_tasks(pid, plan.npus[0], plan.mode)
    h = Held(Binding(pid, start_time(pid), (0,), plan, frozenset(CPUS), frozen_map({}), ()), 0.0)
    h.remember_threads(applied.threads, role_cpus(plan))
    with d.lock:
        d.held = {**d.held, pid: h}
    return h


def _mode(d: Daemon) -> tuple[str, str] | None:
    text = d.metrics.render().decode()
    for mode, reason in [("events", ""), *(("listing", r) for r in ("off", "unsupported", "permission",
                                                                   "namespace", "no_ack", "overflow", "error"))]:
        if metric_value(text, "ascendbind_reconcile_mode", mode=mode, reason=reason) == 1:
            return mode, reason
    return None


def _events_queued(rec: Reconciler, timeout: float = 10.0) -> bool:
    """Wait until the loop's events socket has something queued (False at the deadline)."""
    return bool(select.select([rec.thread_events.fileno()], [], [], timeout)[0])


def _events_or_skip(d: Daemon, rec: Reconciler) -> None:
    rec.pass_once()
    if _mode(d) != ("events", ""):
        pytest.skip(f"no process events here: the loop runs in {_mode(d)}")
    # /healthz says the same as the metric
    assert rec.thread_events.describe() == {"mode": "events", "reason": None}


@two_cpus
def test_with_events_a_thread_born_after_the_bind_is_pinned_by_the_next_pass(loop):
    d, rec = loop()
    _events_or_skip(d, rec)
    main, acl = frozenset(CPUS[:-1]), frozenset(CPUS[-1:])
    with start_worker(plain=2, acl=0, release=0) as w:
        h = _bind(d, w.pid)
        rec.pass_once()  # its first look
        late = w.spawn("acl_thread_2")
        assert w.born_cpus(late) == main  # born where its creator runs
        rec.pass_once()
        assert cpus_allowed_of(w.pid, late) == acl and h.late_threads == 1
        assert h.threads[late].role == "acl" and h.drift_events == 0
        plain = w.spawn("worker_late")  # born on main, where it belongs: nothing to do
        rec.pass_once()
        assert cpus_allowed_of(w.pid, plain) == main and h.late_threads == 1 and plain in h.threads
        w.stop(plain)
        # the kernel queues a thread's exit event just after it drops the thread from
        # /proc, which stop() waits for: wait for the event itself
        assert _events_queued(rec)
        rec.pass_once()
        assert plain not in h.threads  # its exit event: forgotten, its tid free to be a new thread
    assert metric_value(d.metrics.render().decode(), "ascendbind_thread_events_total") >= 4


@two_cpus
def test_with_events_a_thread_renamed_long_after_birth_moves_in_the_next_pass_not_its_sweep_slot(loop):
    d, rec = loop()
    _events_or_skip(d, rec)
    acl = frozenset(CPUS[-1:])
    with start_worker(plain=2, acl=0, release=0) as w:
        h = _bind(d, w.pid)
        old = w.tid_named("worker_0")
        for _ in range(5):  # long past any young pass
            rec.pass_once()
        while (old + rec.passes + 1) % COMM_SWEEP_PASSES == 0:  # the next pass is not its sweep slot
            rec.passes += 1
        w.rename(old, "acl_thread")
        rec.pass_once()
        assert cpus_allowed_of(w.pid, old) == acl and h.threads[old].role == "acl"
        assert h.drift_events == 0  # a rename is no drift


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_the_mask_sweep_reads_each_thread_once_in_k_passes_and_the_main_and_role_threads_every_pass(k):
    pid = 1000
    threads = {pid: SeenThread(frozenset({0}), "main")}
    threads.update({t: SeenThread(frozenset({0}), "main") for t in range(1001, 1201)})
    threads.update({1300: SeenThread(frozenset({1}), "acl"), 1301: SeenThread(frozenset({1}), "release")})
    slots = sweep_slots(pid, threads, k)
    assert len(slots) == k
    for tids, want in slots:
        assert {pid, 1300, 1301} <= set(tids) and len(tids) == len(set(tids))
        assert want == [threads[t].mask for t in tids]  # each tid beside the mask it must have
    plain = [t for tids, _ in slots for t in tids if t not in (pid, 1300, 1301)]
    assert sorted(plain) == list(range(1001, 1201))  # every other thread in exactly one share
    sizes = [len(tids) for tids, _ in slots]
    assert max(sizes) - min(sizes) <= 1  # consecutive tids spread evenly


@two_cpus
def test_with_events_a_quiet_pass_opens_no_file_and_the_next_event_makes_the_pass_look(loop):
    d, rec = loop(memory_check_seconds=0)  # the locality check reads numa_maps on a thread of its own
    _events_or_skip(d, rec)
    acl = frozenset(CPUS[-1:])
    with start_worker(plain=4, acl=1, release=1) as w:
        h = _bind(d, w.pid)
        rec.pass_once()  # its first look reads it whole
        quiet_runs = "ascendbind_reconcile_quiet_runs_total"
        before = metric_value(d.metrics.render().decode(), quiet_runs)
        with Reads() as quiet:
            for _ in range(d.config.drift_sweep_passes):
                rec.pass_once()
        assert quiet.events == []  # no name, no task list, no start time: masks and one poll
        assert metric_value(d.metrics.render().decode(), quiet_runs) == before + d.config.drift_sweep_passes
        late = w.spawn("acl_thread_2")  # a fork and a rename: the events socket is readable
        with Reads() as looked:
            rec.pass_once()
        assert looked.comm_reads([late])[late] >= 1
        assert metric_value(d.metrics.render().decode(), quiet_runs) == before + d.config.drift_sweep_passes
        assert cpus_allowed_of(w.pid, late) == acl and h.late_threads == 1


@two_cpus
def test_with_events_a_worker_that_exits_between_quiet_passes_is_dropped_by_the_next(loop):
    d, rec = loop(memory_check_seconds=0)
    _events_or_skip(d, rec)
    with start_worker(plain=2, acl=1, release=1) as w:
        _bind(d, w.pid)
        rec.pass_once()
        rec.pass_once()
        assert metric_value(d.metrics.render().decode(), "ascendbind_reconcile_quiet_runs_total") >= 1
        pid = w.pid
    # the worker is reaped: its pidfd polls readable
    rec.pass_once()
    assert pid not in d.held


@contextlib.contextmanager
def _movable_irq():
    """An IRQ of this machine whose mask takes CPU 0 alone, and its original mask, put
    back afterwards whatever happened (tests leave the host's IRQs as they found them)."""
    for irq in sorted(int(n) for n in os.listdir("/proc/irq") if n.isdigit()):
        original = read_irq_mask(irq)
        if original is None:
            continue
        try:
            if set_irq_affinity(irq, {CPUS[0]}).status == "ok":
                yield irq, original
                return
        finally:
            restore_irq_masks({irq: original})
    pytest.skip("no IRQ on this machine takes a mask of CPU 0 alone")


@two_cpus
@pytest.mark.skipif(not os.access("/proc/irq", os.W_OK), reason="/proc/irq is not writable here")
def test_with_events_an_irq_mask_moved_between_quiet_passes_is_set_back_by_the_next(loop):
    d, rec = loop(memory_check_seconds=0)
    _events_or_skip(d, rec)
    with _movable_irq() as (irq, original), start_worker(plain=2, acl=1, release=1) as w:
        h = _bind(d, w.pid)
        pinned = (IrqBinding(0, irq, frozenset({CPUS[0]}), original, "ok"),)
        h.binding = dataclasses.replace(h.binding, irqs=pinned)
        rec.pass_once()
        rec.pass_once()
        quiet_runs = metric_value(d.metrics.render().decode(), "ascendbind_reconcile_quiet_runs_total")
        assert quiet_runs >= 1  # the IRQ mask is where the binding set it: the pass stays quiet
        set_irq_affinity(irq, set(CPUS))  # someone else moves it
        rec.pass_once()
        assert parse_mask(read_irq_mask(irq)) == {CPUS[0]} and h.drift["irqs"].culprit is not None
        assert metric_value(d.metrics.render().decode(), "ascendbind_reconcile_quiet_runs_total") == quiet_runs


def _before_slot(rec: Reconciler, tid: int, k: int) -> None:
    """Number the passes so that the k-th pass from now is the first whose share of the
    mask sweep holds ``tid`` by its number (observe.sweep_slots): the next k - 1 skip it."""
    while (rec.passes + k) % k != tid % k:
        rec.passes += 1


@two_cpus
def test_with_events_drift_of_a_plain_thread_is_set_back_by_its_share_of_the_sweep(loop):
    d, rec = loop()
    _events_or_skip(d, rec)
    k = d.config.drift_sweep_passes
    assert k > 1  # the default spreads the sweep
    main = frozenset(CPUS[:-1])
    with start_worker(plain=2, acl=0, release=0) as w:
        h = _bind(d, w.pid)
        rec.pass_once()
        tid = w.tid_named("worker_1")
        _before_slot(rec, tid, k)
        os.sched_setaffinity(tid, set(CPUS))  # someone else moves it, as taskset would
        for _ in range(k - 1):  # passes whose share does not hold it: its mask is not read
            rec.pass_once()
            assert cpus_allowed_of(w.pid, tid) == frozenset(CPUS) and h.drift_events == 0
        rec.pass_once()  # the k-th: its share
        assert cpus_allowed_of(w.pid, tid) == main
        assert h.drift_events == 1 and h.drift["threads"].culprit == "external"


@two_cpus
def test_with_events_one_sweep_pass_checks_every_thread_every_pass(loop):
    d, rec = loop(drift_sweep_passes=1)
    _events_or_skip(d, rec)
    main = frozenset(CPUS[:-1])
    with start_worker(plain=2, acl=0, release=0) as w:
        h = _bind(d, w.pid)
        rec.pass_once()
        for name in ("worker_0", "worker_1"):
            tid = w.tid_named(name)
            os.sched_setaffinity(tid, set(CPUS))
            rec.pass_once()
            assert cpus_allowed_of(w.pid, tid) == main
        assert h.drift_events == 2


@two_cpus
@pytest.mark.parametrize("moved", ["main thread", "acl_thread", "release_thread"])
def test_with_events_a_moved_main_acl_or_release_thread_is_set_back_by_the_next_pass(loop, moved):
    # a whole process moved (taskset -a, a cpuset change) moves its main thread: seen at once
    d, rec = loop()
    _events_or_skip(d, rec)
    k = d.config.drift_sweep_passes
    want = {"main thread": frozenset(CPUS[:-1])}.get(moved, frozenset(CPUS[-1:]))
    with start_worker(plain=2, acl=1, release=1) as w:
        h = _bind(d, w.pid)
        rec.pass_once()
        tid = w.pid if moved == "main thread" else w.tid_named(moved)
        _before_slot(rec, tid, k)  # the next pass is not the one its number falls in
        os.sched_setaffinity(tid, set(CPUS))
        rec.pass_once()
        assert cpus_allowed_of(w.pid, tid) == want
        assert h.drift_events == 1


@two_cpus
def test_with_events_a_worker_bound_between_passes_is_read_whole_on_its_first_look(loop):
    # the socket keeps a worker's events only once a pass has named it in the filter:
    # a rename between the bind and that pass reaches nobody, so the first look reads all names
    d, rec = loop()
    _events_or_skip(d, rec)
    acl = frozenset(CPUS[-1:])
    with start_worker(plain=2, acl=0, release=0) as w:
        h = _bind(d, w.pid)
        tid = w.tid_named("worker_0")
        w.rename(tid, "acl_thread_9")
        rec.pass_once()
        assert cpus_allowed_of(w.pid, tid) == acl and h.threads[tid].role == "acl"


@two_cpus
def test_with_events_a_worker_that_execs_is_read_afresh(loop, tmp_path):
    # exec leaves one thread, renamed after the new program, without a rename event
    d, rec = loop()
    _events_or_skip(d, rec)
    acl = frozenset(CPUS[-1:])
    runtime = tmp_path / "acl_thread_run"
    runtime.symlink_to(os.path.realpath(sys.executable))
    with start_worker(plain=2, acl=0, release=0) as w:
        h = _bind(d, w.pid)
        rec.pass_once()
        w.exec_as(str(runtime))
        rec.pass_once()
        assert set(h.threads) == {w.pid} and h.threads[w.pid].role == "acl"
        assert cpus_allowed_of(w.pid, w.pid) == acl and w.pid in d.held


@two_cpus
def test_lost_events_are_made_good_by_one_full_read_and_persistent_loss_falls_back_to_listing(loop):
    d, rec = loop()
    rec.thread_events = ThreadEvents(d.metrics, opener=lambda: ProcEventSocket.open(buffer_bytes=4096))
    _events_or_skip(d, rec)
    acl = frozenset(CPUS[-1:])
    with start_worker(plain=2, acl=0, release=0) as w:
        h = _bind(d, w.pid)
        rec.pass_once()
        old = w.tid_named("worker_0")
        extra = [w.spawn("worker_x") for _ in range(30)]  # fills the queue many times over
        w.rename(old, "acl_thread")  # its rename event finds the queue full: dropped
        rec.pass_once()
        assert cpus_allowed_of(w.pid, old) == acl  # the full read after the loss found it
        assert set(extra) <= set(h.threads)
        text = d.metrics.render().decode()
        assert metric_value(text, "ascendbind_thread_event_losses_total") == 1
        assert _mode(d) == ("events", "")
        for i in range(LOSS_LIMIT - 1):  # losing events pass after pass: listing is cheaper
            for tid in extra:
                w.rename(tid, f"worker_y{i}")
            rec.pass_once()
        assert _mode(d) == ("listing", "overflow")
        late = w.spawn("acl_thread_5")  # and listing still pins what comes late
        rec.pass_once()
        assert cpus_allowed_of(w.pid, late) == acl


@two_cpus
def test_with_events_off_the_listing_pins_late_threads_and_sweeps_renames(loop):
    d, rec = loop(thread_events=False)
    rec.pass_once()
    assert _mode(d) == ("listing", "off")
    acl = frozenset(CPUS[-1:])
    with start_worker(plain=2, acl=0, release=0) as w:
        h = _bind(d, w.pid)
        rec.pass_once()
        late = w.spawn("acl_thread_2")
        rec.pass_once()  # the thread count changed: listed, named, pinned
        assert cpus_allowed_of(w.pid, late) == acl
        old = w.tid_named("worker_0")
        for _ in range(4):  # past its young passes
            rec.pass_once()
        while (old + rec.passes + 1) % COMM_SWEEP_PASSES == 0:
            rec.passes += 1
        w.rename(old, "acl_thread")
        rec.pass_once()
        assert h.threads[old].role == "main"  # no event, no name read: not seen yet
        while (old + rec.passes + 1) % COMM_SWEEP_PASSES:
            rec.pass_once()
        rec.pass_once()  # its sweep slot
        assert cpus_allowed_of(w.pid, old) == acl and h.threads[old].role == "acl"
    assert metric_value(d.metrics.render().decode(), "ascendbind_thread_events_total") == 0


@two_cpus
def test_a_daemon_in_its_own_network_namespace_falls_back_to_listing_and_says_why():
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare missing")
    directory = tempfile.mkdtemp(prefix="ascendbind-netns-", dir="/tmp")
    # a fresh network namespace has no usable loopback: /metrics is read over the socket
    env = base_env(f"{directory}/s.sock", f"{directory}/state", 1)
    d = DaemonProc(directory, env, argv=[unshare, "-n", sys.executable, "-m", "ascendbind.cli", "serve"])
    env["ASCENDBIND_METRICS_LISTEN"] = ""  # no TCP listener
    try:
        d.start()
        d.wait_discovered()

        def metric(name: str, **labels: str) -> float | None:
            status, text = d.curl("GET", "/metrics")
            return metric_value(text, name, **labels) if status == 200 else None

        assert wait_for(lambda: metric("ascendbind_reconcile_mode", mode="listing", reason="namespace") == 1,
                        30), d.log()[-3000:]
        assert d.client.health()["reconcile"] == {"mode": "listing", "reason": "namespace"}
        with start_worker(plain=1, acl=0, release=0) as w:
            plan = d.client.bind(w.pid, 0)["plan"]["npus"]["0"]
            main, acl, release = (frozenset(plan[r]) for r in ("main", "acl", "release"))
            assert acl != main and release != main
            late = w.spawn("acl_thread_2")
            assert wait_for(lambda: cpus_allowed_of(w.pid, late) == acl, 30), d.log()[-3000:]
            named = w.spawn("worker_late")
            w.rename(named, "release_thread")  # caught while young, or by its sweep slot
            assert wait_for(lambda: cpus_allowed_of(w.pid, named) == release, 60), d.log()[-3000:]
        assert metric("ascendbind_thread_events_total") == 0
        assert "reconcile learns of thread changes by listing" in d.log()
    finally:
        d.stop()
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------- process starts (the host isolation level)


def test_started_processes_are_forks_of_a_process_and_execs_each_once():
    events = [ProcEvent("fork", 50, 50), ProcEvent("fork", 40, 41), ProcEvent("exec", 60, 60),
              ProcEvent("comm", 50, 50, comm="x"), ProcEvent("exit", 70, 70), None, ProcEvent("exec", 50, 50)]
    assert started_processes(events) == ([50, 60], 1)  # a new thread (41 of 40) is no new process


def test_the_kernel_keeps_only_process_starts_and_execs_for_the_host_level():
    src = _open_or_skip(program=process_start_filter())
    try:
        assert src.filtered
        with start_worker(plain=1, acl=0, release=0) as w:
            _events(src)  # whatever came before
            tid = w.spawn("worker_new")  # a thread: fork (child tid != tgid), comm; then its exit
            w.stop(tid)
            child = subprocess.Popen(["true"])  # a process: fork, then exec; then its exit
            child.wait()
            got, lost = _events_until(src, lambda evs: any(e.kind == "exec" and e.tgid == child.pid for e in evs))
            mine = [e for e in got if e.tgid in (w.pid, child.pid)]
            assert not lost and ("fork", child.pid) in {(e.kind, e.tgid) for e in mine}, got
            assert {e.kind for e in got} <= {"fork", "exec", "ack"}, {e.kind for e in got}
            assert all(e.tid == e.tgid for e in got if e.kind == "fork"), got  # no thread's fork passed
            assert child.pid in started_processes(got)[0]
    finally:
        src.close()
