"""A bound worker that floods the daemon with thread events is followed by listing alone,
while every other worker keeps its events.

The budget's bookkeeping (eventbudget.py) is driven with plain counts and a clock.
The loop is driven pass by pass on a real ``Daemon`` (as test_thread_events.py does)
and as a real ``ascendbind serve``, with a real flooding worker
(tests/hostile_workers.py: threads started, named ``acl_thread_<n>`` and ended in a
tight loop) and a second, quiet worker whose late ACL thread must still be pinned.
No latency is asserted here: bench/thread_flood.py measures it.
"""

from __future__ import annotations

import os
import select

import pytest

from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.watch.eventbudget import (BASE_COOLDOWN, BLAME_MIN, BURST_SECONDS, MAX_COOLDOWN, PROBE_SECONDS,
                                                 EventBudget)
from ascendbind.daemon.watch.reconcile import Reconciler
from ascendbind.daemon.watch.threadevents import LOSS_LIMIT, ThreadEvents
from ascendbind.discovery.parse.proc_events import ProcEvent, parse_events, thread_changes
from ascendbind.discovery.read.proc_connector import ProcEventSocket
from ascendbind.values.config import Config
from ascendbind.errors import ConfigError, DiscoveryError
from tests.daemon_harness import metric_value, running_daemon, wait_for
from tests.hostile_workers import thread_flood_worker
from tests.test_thread_events import CPUS, _bind, _events_or_skip, _events_queued, _mode, two_cpus
from tests.workers import cpus_allowed_of, start_worker

# ---------------------------------------------------------------- the budget alone

RATE = 100.0  # events a second; a burst of BURST_SECONDS of them
A, B = 4200, 5100


def test_a_worker_within_its_rate_is_never_over_and_a_burst_is_allowed_once():
    budget = EventBudget(RATE)
    assert budget.charge({A: int(RATE * BURST_SECONDS)}, 0.0) == frozenset()  # a start-up burst
    for second in range(1, 30):  # then exactly its rate, second by second
        assert budget.charge({A: int(RATE)}, float(second)) == frozenset()
    assert budget.listing() == frozenset()


def test_a_worker_over_its_budget_is_listed_alone_probed_after_its_cooldown_and_let_back_when_calm():
    budget = EventBudget(RATE)
    assert budget.charge({A: 5, B: int(RATE * BURST_SECONDS) + 1}, 0.0) == {B}
    assert budget.listing() == {B}
    assert budget.charge({A: 5, B: 10**6}, 0.5) == frozenset()  # its stray events are not charged again
    assert budget.due(BASE_COOLDOWN - 0.01) == frozenset()
    assert budget.due(BASE_COOLDOWN) == {B}
    opened = BASE_COOLDOWN
    assert budget.settle(B, 3, False, 0.1, opened + 0.1) is None  # too early to tell
    assert budget.settle(B, 3, False, PROBE_SECONDS, opened + PROBE_SECONDS) is True
    assert budget.listing() == frozenset()
    now = opened + PROBE_SECONDS
    assert budget.describe(B, now) == {"over_budget": False, "overflows": 1, "retry_in_seconds": None}
    # let back with one second's worth: a flood goes over again within it
    assert budget.charge({B: int(RATE) + 1}, now) == {B}


@pytest.mark.parametrize("events,lost", [(0, True), (int(RATE * PROBE_SECONDS) + 1, False)])
def test_a_probe_that_overflowed_or_heard_more_than_the_rate_keeps_the_worker_over(events, lost):
    budget = EventBudget(RATE)
    budget.charge({A: 10**6}, 0.0)
    assert budget.settle(A, events, lost, PROBE_SECONDS, BASE_COOLDOWN + PROBE_SECONDS) is False
    assert budget.listing() == {A} and budget.describe(A, BASE_COOLDOWN + PROBE_SECONDS)["overflows"] == 2


def test_each_probe_that_finds_the_flood_doubles_the_cooldown_up_to_its_cap():
    budget, now = EventBudget(RATE), 0.0
    assert budget.charge({A: 10**6}, now) == {A}
    cooldowns = [budget.describe(A, now)["retry_in_seconds"]]
    for _ in range(9):
        now += cooldowns[-1]
        assert budget.due(now) == {A}
        assert budget.settle(A, 0, True, 0.0, now) is False  # the probe's queue overflowed at once
        cooldowns.append(budget.describe(A, now)["retry_in_seconds"])
    assert cooldowns[:4] == [BASE_COOLDOWN, 2 * BASE_COOLDOWN, 4 * BASE_COOLDOWN, 8 * BASE_COOLDOWN]
    assert max(cooldowns) == MAX_COOLDOWN and cooldowns[-1] == MAX_COOLDOWN
    assert budget.describe(A, now)["overflows"] == 10
    now += MAX_COOLDOWN + PROBE_SECONDS
    assert budget.settle(A, 0, False, PROBE_SECONDS, now) is True
    # within budget for the cap's length after being let back: the next cooldown is the base again
    now += MAX_COOLDOWN
    assert budget.charge({A: 10**6}, now) == {A}
    assert budget.describe(A, now)["retry_in_seconds"] == BASE_COOLDOWN


def test_a_lost_read_puts_the_worker_that_sent_most_of_it_over_at_once():
    budget = EventBudget(10_000)  # a budget no read here exceeds
    assert budget.charge({A: BLAME_MIN, B: BLAME_MIN - 1}, 0.0, lost=True) == {A}  # A filled the queue
    assert budget.charge({B: 40, 77: 40, 78: 40}, 0.0, lost=True) == frozenset()  # none sent most of it
    assert budget.charge({B: BLAME_MIN - 1}, 0.0, lost=True) == frozenset()  # too few to tell
    assert budget.charge({B: 5000}, 0.0, lost=False) == frozenset()


def test_released_workers_are_forgotten():
    budget = EventBudget(RATE)
    budget.charge({A: 10**6, B: 1}, 0.0)
    budget.keep({B})
    assert budget.listing() == frozenset()
    assert budget.describe(A, 0.0) == {"over_budget": False, "overflows": 0, "retry_in_seconds": None}


def test_events_are_counted_per_worker_and_a_listed_worker_leaves_the_changes():
    events = [ProcEvent("fork", A, 4242), ProcEvent("comm", A, 4242, "acl_thread"), ProcEvent("exit", A, 4242),
              ProcEvent("fork", B, 5101), ProcEvent("exec", B, B), ProcEvent("fork", 9, 10)]
    ch = thread_changes(events, {A, B})
    assert ch.counts == {A: 3, B: 2} and ch.events == 5
    rest = ch.without({B})
    assert rest.counts == {A: 3} and rest.events == 3 and set(rest.look) == {A} and rest.resync == frozenset()


@pytest.mark.parametrize("value", [9, 1_000_001, "x", 2.5])
def test_the_budget_key_takes_a_whole_number_of_events_a_second_in_range(value):
    with pytest.raises(ConfigError, match="thread_event_budget"):
        Config(thread_event_budget=value)


# ---------------------------------------------------------------- the loop, pass by pass


@pytest.fixture
def loop(tmp_path):
    """A real Daemon and its reconcile loop, driven pass by pass by the test; closed after it."""
    made: list[Reconciler] = []

    def make(**cfg) -> tuple[Daemon, Reconciler]:
        d = Daemon(Config(state_dir=str(tmp_path / "state"), **cfg))
        made.append(Reconciler(d))
        return d, made[-1]

    yield make
    for rec in made:
        rec.close()



@two_cpus
def test_a_worker_that_overflows_the_queue_is_listed_alone_and_the_loop_stays_on_events(loop):
    # a budget no read here exceeds, a queue of a few hundred events, a clock that stands still
    # (no cooldown ends): only the overflow itself can put the flooder over
    d, rec = loop(thread_event_budget=1_000_000)
    rec.thread_events = ThreadEvents(d.metrics, opener=lambda: ProcEventSocket.open(buffer_bytes=64 << 10),
                                     clock=lambda: 0.0)
    _events_or_skip(d, rec)
    acl = frozenset(CPUS[-1:])
    with start_worker(plain=2, acl=0, release=0) as w, thread_flood_worker(2) as flooder:
        _bind(d, w.pid)
        _bind(d, flooder.pid)
        rec.pass_once()  # their first looks
        flooder.flood(True)
        assert _queue_overflowed(rec)
        rec.pass_once()
        assert rec.thread_events.budget.listing() == {flooder.pid}
        for _ in range(LOSS_LIMIT + 2):  # a flood that goes on: every pass lists it, none loses events
            rec.pass_once()
        assert _mode(d) == ("events", "")  # the whole loop stays on events
        state = rec.thread_events.worker(flooder.pid)
        assert state["mode"] == "listing" and state["reason"] == "over_budget" and state["overflows"] == 1
        assert rec.thread_events.worker(w.pid) == {"mode": "events", "reason": None, "overflows": 0,
                                                   "retry_in_seconds": None}
        late = w.spawn("acl_thread_2")
        assert _events_queued(rec)
        rec.pass_once()
        assert cpus_allowed_of(w.pid, late) == acl
        text = d.metrics.render().decode()
        assert metric_value(text, "ascendbind_thread_event_losses_total") >= 1
        assert metric_value(text, "ascendbind_thread_event_overflows_total") == 1
        assert metric_value(text, "ascendbind_thread_event_listing_workers") == 1
        flooder.flood(False)


def _queue_overflowed(rec, timeout: float = 30.0) -> bool:
    """Wait until the events socket reports an overflow (the kernel sets ENOBUFS on it: POLLERR)."""
    poller = select.poll()
    poller.register(rec.thread_events.fileno(), select.POLLERR)
    return bool(poller.poll(timeout * 1000))


def _passed(rec) -> bool:
    rec.pass_once()
    return True


@two_cpus
def test_a_worker_over_budget_is_followed_by_listing_and_let_back_to_events_once_quiet(loop):
    d, rec = loop(thread_event_budget=300)
    clock = [0.0]
    rec.thread_events = ThreadEvents(d.metrics, clock=lambda: clock[0])
    _events_or_skip(d, rec)
    acl = frozenset(CPUS[-1:])
    with thread_flood_worker(1) as flooder:
        h = _bind(d, flooder.pid)
        rec.pass_once()
        flooder.flood(True)
        assert wait_for(lambda: _passed(rec) and flooder.pid in rec.thread_events.budget.listing(), 30)
        flooder.flood(False)
        # a long-lived thread renamed while its events are not followed: no event reaches the loop
        creator = min(int(t) for t in os.listdir(f"/proc/{flooder.pid}/task") if int(t) != flooder.pid)
        flooder.rename(creator, "acl_thread")
        rec.pass_once()  # a listing look
        assert rec.thread_events.worker(flooder.pid)["reason"] == "over_budget"
        clock[0] += MAX_COOLDOWN  # its cooldown passes: a probe of its own is opened
        rec.pass_once()
        assert rec.thread_events.worker(flooder.pid)["reason"] == "over_budget"
        clock[0] += PROBE_SECONDS  # the probe heard nothing much: let back
        rec.pass_once()  # its threads read whole once, then followed by events again
        assert rec.thread_events.worker(flooder.pid)["mode"] == "events"
        assert cpus_allowed_of(flooder.pid, creator) == acl and h.threads[creator].role == "acl"
        assert metric_value(d.metrics.render().decode(), "ascendbind_thread_event_listing_workers") == 0


# ---------------------------------------------------------------- a real daemon


@two_cpus
def test_a_real_daemon_lists_the_flooder_and_pins_the_other_workers_late_acl_threads(tmp_path):
    with running_daemon(str(tmp_path), ASCENDBIND_THREAD_EVENT_BUDGET="300", ASCENDBIND_ALLOW_SHARED_NPU="true") as d:
        d.wait_discovered()
        if d.client.health()["reconcile"]["mode"] != "events":
            pytest.skip(f"no process events for the loop: {d.client.health()['reconcile']}")
        with start_worker(plain=1, acl=0, release=0) as w, thread_flood_worker(2) as flooder:
            plan = d.client.bind(w.pid, 0)["plan"]["npus"]["0"]
            d.client.bind(flooder.pid, 0)
            acl = frozenset(plan["acl"])
            assert acl != frozenset(plan["main"])
            flooder.flood(True)
            assert wait_for(lambda: d.client.worker(flooder.pid)["thread_events"]["reason"] == "over_budget", 30), \
                d.log()[-3000:]
            assert metric_value(d.metrics_text(), "ascendbind_thread_event_overflows_total") >= 1
            for name in ("acl_thread", "acl_thread_1"):  # while the flood goes on
                late = w.spawn(name)
                assert wait_for(lambda: cpus_allowed_of(w.pid, late) == acl, 30), d.log()[-3000:]
            assert d.client.worker(w.pid)["thread_events"]["mode"] == "events"
            assert d.client.health()["reconcile"] == {"mode": "events", "reason": None}
            flooder.flood(False)
            # once quiet, let back to events after its cooldown (doubled by each probe during the flood)
            assert wait_for(lambda: d.client.worker(flooder.pid)["thread_events"]["mode"] == "events",
                            3 * MAX_COOLDOWN), d.log()[-3000:]
            text = d.metrics_text()
            assert metric_value(text, "ascendbind_reconcile_mode", mode="listing", reason="overflow") == 0
            assert metric_value(text, "ascendbind_thread_event_listing_workers") == 0


# ---------------------------------------------------------------- the kernel fact the loss rule rests on


def test_after_an_overflow_the_kernel_drops_every_event_silently_until_a_read_empties_the_queue():
    try:
        src = ProcEventSocket.open(buffer_bytes=4096)  # the kernel's floor: a handful of events
    except DiscoveryError as exc:
        pytest.skip(f"no process events here: {exc}")
    try:
        with start_worker(plain=1, acl=0, release=0) as w:
            src.set_filter([w.pid])
            for _ in range(40):  # far more than the queue holds
                w.spawn("worker_x")
            got, lost = src.read(limit=1)
            assert lost and not src.drained  # ENOBUFS said once; events still queued
            tid = w.tid_named("worker_0")
            w.rename(tid, "while_congested")  # dropped: the queue was not emptied since
            events = []
            while not src.drained or not events:
                batch, _ = src.read()
                events += [e for d in batch for e in parse_events(d)]
            assert src.drained and "while_congested" not in [e.comm for e in events if e is not None]
            w.rename(tid, "after_draining")
            assert _events_queued_on(src)
            batch, lost = src.read()
            assert not lost and "after_draining" in [e.comm for d in batch for e in parse_events(d) if e is not None]
    finally:
        src.close()


def _events_queued_on(src: ProcEventSocket, timeout: float = 10.0) -> bool:
    return bool(select.select([src.fileno()], [], [], timeout)[0])
