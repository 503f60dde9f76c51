"""The reconcile loop: keep bound workers bound. A thin shell around lifecycle.py.

Every ``reconcile_seconds`` (a ``poll`` on a stop flag, stopflag.py, so an idle
daemon sleeps; ``stop()`` wakes it at once), each held worker gets one look, the
rules decide what it calls for, and the ``Daemon`` does it:

1. gone? (absent, zombie, or the pid now names another process: the worker's
   own pidfd says so, even for a newcomer forked in the tick the worker was
   born in) -> dropped; its IRQ masks are restored only for NPUs no live
   worker owns;
2. its threads (observe.py): threads born since the last look, or renamed into
   another role, are pinned by role (a late ``acl_thread`` ends on the ACL CPU);
3. threads whose mask differs from the one we set were moved by someone else:
   that is *drift*. The look then reads the worker's evidence (evidence.py) and
   the rules blame a culprit (blame.py) and re-assert, or, past
   ``REASSERT_LIMIT`` re-asserts within ``window`` seconds, leave it alone;
4. IRQ masks we wrote are checked the same way (``irqbalance`` / ``external``);
5. its cgroup cpuset: one ``pread`` of the effective-CPUs file held open
   (discovery/gather/cpusetprobe.py) says whether it is still the one the
   binding was planned from, and one ``stat`` a pass whether kubelet's CPU
   manager checkpoint changed (for ``pool_source = auto`` workers). A changed
   cpuset, found before the threads are looked at, is never drift: the kernel
   moved them (blame ``cpuset``), and the worker is planned again from its new
   CPUs after the pass's looks, outside the lock, left alone or not. A drift seen
   while the probe's cgroup is unchanged opens the probe again (the worker may
   have been moved to another cgroup), and the same look decides;
6. every ``memory_check_seconds``, the share of its memory on its pool's NUMA
   nodes is measured in the background (locality.py), and the memory step run
   again when the rules say so.

Cost per pass. Where the kernel's process events are had (threadevents.py),
a pass first polls the events socket and every worker's pidfd at once; with
nothing queued and nobody exited it reads only its share of the masks
(observe.sweep_slots: each worker's main, ACL and release threads, and one in
``drift_sweep_passes`` of the others) and the IRQ masks it wrote, and if all
are in place it ends there (``_quiet``): nearly every pass of an idle daemon.
Otherwise: one sched_getaffinity per thread of a worker with news (the same
share for one without), ``comm`` only for the threads an
event named; in listing mode every mask, one O(1) thread count per worker more, and
``comm`` for the few threads whose name can have changed (observe.py);
whether a worker is still there is one ``poll`` over pidfds held for all of
them (reading each worker's ``stat`` would walk all its threads in the kernel):
a copy of the pidfd the worker's record holds since its bind (or since a
restart pinned it again), else one opened here and proven by the start time
read after it; the start time alone where no pidfd can be had or ``proc_root``
is not the host's. (A pidfd reports the exit of the whole thread group: a worker whose
main thread called pthread_exit while others run stays held until the last one
goes, where its ``stat`` alone would already say zombie.) The pass's CPU time is measured on its own thread
(``time.thread_time``), so the metric stays honest when the host is busy.
"""

from __future__ import annotations

import os
import select
import threading
import time

import structlog

from ...discovery.gather.identity import verify_identity
from ...values.cpulist import parse_mask
from ...discovery.gather.irqhost import irqbalance_pids, read_irq_mask
from ...discovery.read.pin import LIVE_PROC
from ...discovery.read.tasks import exited_pidfds, open_pidfd
from ...errors import ProcessGone
from ...eventfd import EFD_CLOEXEC, EFD_NONBLOCK, eventfd, eventfd_read, eventfd_write
from ...discovery.gather.cpusetprobe import CpusetProbe, checkpoint_stamp, open_cpuset_probe
from .evidence import read_evidence
from .lifecycle import REASSERT_LIMIT, CpusetNews, Limits, Observation, Replan, decide, wanted
from .observe import Slot, observe_marked, observe_threads, role_cpus, slot_quiet, sweep_slots
from ..runtime.stopflag import StopFlag
from .threadevents import EventLook, ThreadEvents
from ..runtime.threadname import name_os_thread

__all__ = ["Reconciler", "WAKE_GAP"]

log = structlog.get_logger("ascendbind.reconcile")


_NOTHING = Observation()
_UNSEEN = object()  # the checkpoint not looked at yet

# seconds a pass woken by events waits before the next wake: a worker that starts and ends
# threads all the time costs at most 1 / WAKE_GAP looks a second, and a late role thread
# waits at most this long more
WAKE_GAP = 0.01


def _token(h):
    """What a held record's pidfd here stands for: its pin (bound again, even by a newcomer
    with the same start time, it has another), else its start time."""
    return h.pin if h.pin is not None else h.binding.start_time


def _irq_targets(binding) -> dict[int, frozenset[int]]:
    """IRQ -> the CPUs the irq step set it to (only writes that succeeded)."""
    return {w.irq: w.cpus for w in binding.irqs if w.pinned}


class Reconciler:
    def __init__(self, daemon, *, reassert_limit: int = REASSERT_LIMIT, window: float | None = None) -> None:
        self.daemon = daemon
        self.reassert_limit = reassert_limit
        self._window = window
        self._stop = StopFlag()
        self._poked = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)  # poke(): the held table changed
        self._thread: threading.Thread | None = None
        self.last_pass = time.monotonic()
        self.passes = 0  # staggers the comm sweep (observe.comm_due)
        # pid -> (what the pidfd was taken for: the record's pin, else its start time; a pidfd of our own)
        self._pidfds: dict[int, tuple[object, int]] = {}
        self._unchecked: set[int] = set()  # pidfds opened this pass: their identity is read once
        self.thread_events = ThreadEvents(daemon.metrics)
        self._looked: dict[int, dict] = {}  # pid -> the thread cache its last look kept (new cache: new binding)
        self._roles: dict[int, tuple] = {}  # pid -> (plan, role_cpus(plan)): plans change only on a (re)bind
        # pid -> (thread cache, its size, sweep_slots of it): kept while only quiet looks ran
        self._slots: dict[int, tuple[dict, int, tuple[Slot, ...]]] = {}
        self._quiet_poll = None  # select.poll over the events socket and the pidfds (_arm_quiet)
        self._quiet_pids: frozenset[int] = frozenset()
        self.locality = daemon.locality
        # pid -> (_token of the record it was opened for, its cpuset probe or None: nothing to watch)
        self._probes: dict[int, tuple[object, CpusetProbe | None]] = {}
        self._stamp: object = _UNSEEN  # kubelet's checkpoint as last seen (None: absent)
        self._pool_proof_due: set[int] = set()  # workers whose pool proof to check again (the checkpoint changed)

    @property
    def interval(self) -> float:
        return max(0.2, float(self.daemon.config.reconcile_seconds))

    @property
    def window(self) -> float:
        return self._window if self._window is not None else max(60.0, 10 * self.interval)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reconcile", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.locality.close()  # no round starts once the loop is stopped
        if self._thread is None or not self._thread.is_alive():
            self.close()

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and \
            time.monotonic() - self.last_pass < 3 * self.interval + 30

    def poke(self) -> None:
        """The held table changed (a bind, a release): the loop wakes to give a newly bound
        worker its first look and to have the kernel keep its events, now, not a pass later."""
        try:
            eventfd_write(self._poked, 1)
        except OSError:  # closed: the loop has stopped
            pass

    def _run(self) -> None:
        name_os_thread()
        due = time.monotonic()  # the events source is opened at once
        while True:
            fd = self.thread_events.wake_fd()
            left = due - time.monotonic()
            if self._stop.wait_or_readable((self._poked,) if fd is None else (self._poked, fd), left):
                return
            try:
                eventfd_read(self._poked)
            except OSError:  # not poked (EAGAIN)
                pass
            try:
                if time.monotonic() < due:
                    self.news_pass()  # woken by events: the workers with news, at once
                    if self._stop.wait(WAKE_GAP):  # a churning worker wakes the loop at most this often
                        return
                    continue
                if self.passes == 0:
                    self.news_pass()  # the first wake: open the events source, a first look at everyone
                    self.passes = 1
                else:
                    self.pass_once()
            except Exception:  # a bug in one pass must not end reconciling for good
                log.exception("reconcile pass crashed")
            self.last_pass = time.monotonic()
            due = self.last_pass + self.interval

    @property
    def limits(self) -> Limits:
        cfg = self.daemon.config
        return Limits(self.reassert_limit, self.window, cfg.memory_local_threshold, cfg.memory_rerun_seconds)

    # ------------------------------------------------------------ one pass

    def pass_once(self) -> None:
        d = self.daemon
        t0, c0 = time.monotonic(), time.thread_time()
        self.passes += 1
        held = d.reader.records()
        self._checkpoint(held)
        if self._quiet(held):
            d.metrics.reconcile_quiet_runs.inc()
        else:
            self._look(held)
        self._memory_locality(held)
        d.metrics.reconcile_runs.inc()
        d.metrics.reconcile_duration.observe(time.monotonic() - t0)
        d.metrics.reconcile_cpu.observe(time.thread_time() - c0)

    def _quiet(self, held) -> bool:
        """Whether this pass can tell, cheaply, that looking at every worker would find
        nothing: in events mode, one ``poll`` over the events socket and every worker's
        pidfd says no event is queued and nobody exited, every worker has had its first
        look, and each one's share of the mask sweep and its IRQ masks are where we set
        them. Anything else (or a worker bound, released or without a pidfd since the
        last full pass) and the pass looks at everyone (``_look``). An idle daemon's
        passes are nearly all quiet, and each wakes on cold caches: the less code and
        memory it touches, the less it costs."""
        poller = self._quiet_poll
        if poller is None or held.keys() != self._quiet_pids or not self.daemon.config.thread_events:
            return False
        if self.thread_events.budget.listing():
            return False  # a worker over its event budget sends no events: only a listing sees its threads
        if poller.poll(0) or self._pool_proof_due:
            return False  # events queued (or the socket's error: lost events), or a worker exited
        def quiet(_) -> bool:
            for pid, h in held.items():
                if self._cpuset_news(h) is not None:
                    return False
                looks = wanted(h.record())
                if looks.threads and (self._looked.get(pid) is not h.threads  # bound (again) since its last look
                                      or not slot_quiet(self._slot(h))):
                    return False
                if looks.irqs and h.binding.irqs and self._moved_irqs(h):
                    return False
            return True
        return self.daemon.reader.read(quiet)  # the records as the full look would see them

    def news_pass(self) -> None:
        """Between passes, woken by the events socket: the workers the events name get
        their look (a thread born or renamed into a role is pinned now, not a pass later);
        nobody else is looked at. Events lost or unknown: a full look."""
        d = self.daemon
        held = d.reader.records()
        events = self.thread_events.events(self.passes, held, d.config.thread_events, d.config.thread_event_budget)
        if events is None:
            return  # listing mode: the passes look, as they always did
        if events.reread_all:
            self._look(held, events)
            return
        changes = events.changes
        news = [pid for pid in sorted(set(changes.look) | changes.resync | events.reread | {  # and those bound since the last look
            p for p, h in held.items() if self._looked.get(p) is not h.threads}) if pid in held]
        if not news:
            return
        d.metrics.reconcile_woken_runs.inc()
        # still the worker bound? its pidfd says so where one was proven; else its identity is read
        proven = {pid: fd for pid, (token, fd) in self._pidfds.items()
                  if pid in held and token == _token(held[pid]) and pid not in self._unchecked}
        exited = {pid for pid, fd in proven.items() if fd in exited_pidfds([fd])}
        limits, dirty = self.limits, False
        replans: list[tuple[object, Replan]] = []
        for pid in news:
            h = held[pid]
            with d.looking_at(h) as current:
                if not current:
                    continue
                obs = self.observe(h, check_identity=pid not in proven or pid in exited, events=events)
                if obs != _NOTHING:
                    dirty |= self._act(h, obs, limits, replans)
        self._replan(replans)
        if dirty:
            d.commit()

    def _look(self, held, events: EventLook | None = None) -> None:
        """One look at every held worker, and the actions they call for (``events``: read
        already by the caller, else read here)."""
        d = self.daemon
        if events is None:
            events = self.thread_events.events(self.passes, held, d.config.thread_events, d.config.thread_event_budget)
        for pid in [p for p in self._looked if p not in held]:
            del self._looked[pid]
            self._roles.pop(pid, None)
            self._slots.pop(pid, None)
        self._forget_probes(held)
        maybe_gone = self._maybe_gone(held)
        limits = self.limits
        dirty = False
        replans: list[tuple[object, Replan]] = []
        for pid in sorted(held):
            h = held[pid]
            with d.looking_at(h) as current:
                if not current:
                    continue
                obs = self.observe(h, check_identity=pid in maybe_gone, events=events)
                if obs != _NOTHING:  # a look that saw nothing calls for nothing (lifecycle's rule)
                    dirty |= self._act(h, obs, limits, replans)
        self._replan(replans)
        if dirty:
            d.commit()
        self._arm_quiet(held, events)

    def _act(self, h, obs: Observation, limits: Limits, replans: list) -> bool:
        """Ask the rules what ``obs`` calls for and hand it to the ``Daemon`` (under its lock);
        a re-plan waits in ``replans`` for the end of the looks. True: the state changed."""
        actions = decide(h.record(), obs, time.monotonic(), limits)
        replans.extend((h, a) for a in actions if isinstance(a, Replan))
        rest = [a for a in actions if not isinstance(a, Replan)]
        return self.daemon.act(h, rest, window=limits.window) if rest else False

    def _replan(self, replans: list) -> None:
        """The re-plans the looks called for, outside the lock: each reads its worker's facts
        (the Daemon saves the state file for the ones it records)."""
        for h, a in replans:
            self.daemon.replan_cpuset(h, a)

    # ------------------------------------------------------------ cpusets

    def _checkpoint(self, held) -> None:
        """One ``stat`` of kubelet's checkpoint while a held worker's pool may depend on it
        (``pool_source = auto``); when it changed, the workers its proof could move onto
        their own cpuset (planned by the placement rules, or stuck on a cpuset no plan
        fit) are due a look at their proof."""
        cfg = self.daemon.config
        auto = [pid for pid, h in held.items() if (h.pool_source or cfg.pool_source) == "auto"]
        if not auto:
            return
        stamp = checkpoint_stamp(self.daemon.hosts.source)
        if stamp == self._stamp:
            return
        # the first sight of it counts as a change too: it may have changed since a bind read it
        # (a look that finds no new proof re-plans nothing)
        self._stamp = stamp
        self._pool_proof_due.update(pid for pid in auto
                               if held[pid].binding.plan.pool_source is None or held[pid].cpuset_stuck is not None)

    def _probe(self, h, *, reopen: bool = False) -> CpusetProbe | None:
        """``h``'s cpuset probe, opened at its first look (or again with ``reopen``); None for
        a worker planned from its Cpus_allowed_list (no readable cpuset to watch)."""
        pid, token = h.binding.pid, _token(h)
        kept = self._probes.get(pid)
        if kept is not None and kept[0] == token and not reopen:
            return kept[1]
        if kept is not None and kept[1] is not None:
            kept[1].close()
        facts = h.facts
        watch = facts is None or facts[1].allowed_source == "cgroup"
        probe = open_cpuset_probe(self.daemon.hosts.source, pid) if watch else None
        self._probes[pid] = (token, probe)
        return probe

    def _cpuset_news(self, h, *, reopen: bool = False) -> CpusetNews | None:
        """What changed of ``h``'s cpuset since its binding was planned (one ``pread``), or its
        proof being due (the checkpoint changed); None: nothing."""
        probe = self._probe(h, reopen=reopen)
        now = probe.cpus() if probe is not None else None
        if now is None:
            self._pool_proof_due.discard(h.binding.pid)
            return None
        before = h.cpuset_seen if h.cpuset_seen is not None else frozenset(h.binding.plan.allowed_cpus)
        if now != before:
            self._pool_proof_due.discard(h.binding.pid)
            planned = frozenset().union(*(p.pool for p in h.binding.plan.npus))
            return CpusetNews(before, now, "cpuset_changed", moved=not planned <= now)
        if h.binding.pid in self._pool_proof_due:
            self._pool_proof_due.discard(h.binding.pid)
            return CpusetNews(before, now, "checkpoint_changed")
        return None

    def _forget_probes(self, held) -> None:
        for pid in [p for p in self._probes if p not in held]:
            probe = self._probes.pop(pid)[1]
            if probe is not None:
                probe.close()
        self._pool_proof_due &= set(held)

    def _arm_quiet(self, held, events: EventLook | None) -> None:
        """After a full pass: the poll set ``_quiet`` watches until the held set changes."""
        self._quiet_poll, self._quiet_pids = None, frozenset()
        fd = self.thread_events.fileno()
        if events is None or fd is None or self._unchecked or any(pid not in self._pidfds for pid in held):
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        for _start, pidfd in self._pidfds.values():
            poller.register(pidfd, select.POLLIN)
        self._quiet_poll, self._quiet_pids = poller, frozenset(held)

    def _maybe_gone(self, held) -> set[int]:
        """The pids whose identity must be read this pass: those whose pidfd says the
        process exited, and those without a pidfd (not opened yet, or none to be had)."""
        live_pidfds = self.daemon.config.proc_root == LIVE_PROC
        for pid in [p for p, (token, _fd) in self._pidfds.items() if p not in held or _token(held[p]) != token]:
            os.close(self._pidfds.pop(pid)[1])
        if live_pidfds:
            for pid, h in held.items():
                if pid not in self._pidfds:
                    fd = h.pin.dup_fd() if h.pin is not None else None  # the worker's own: nothing to prove
                    if fd is None and h.pin is None:
                        fd = open_pidfd(pid)  # opened before the identity check, so it names the checked process
                        if fd is not None:
                            self._unchecked.add(pid)
                    if fd is not None:
                        self._pidfds[pid] = (_token(h), fd)
        by_fd = {fd: pid for pid, (_start, fd) in self._pidfds.items()}
        exited = {by_fd[fd] for fd in exited_pidfds(by_fd)}
        unchecked, self._unchecked = self._unchecked, set()
        return {pid for pid in held if pid not in self._pidfds} | exited | unchecked

    def close(self) -> None:
        self._stop.close()
        if self._poked >= 0:
            os.close(self._poked)
            self._poked = -1
        self.thread_events.close()
        for _start, fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        for _token_, probe in self._probes.values():
            if probe is not None:
                probe.close()
        self._probes.clear()

    def observe(self, h, *, check_identity: bool = True, events: EventLook | None = None) -> Observation:
        """One look at ``h`` (under the daemon lock): what the rules need, no more.
        ``events``: this pass's process events (None: the loop runs in listing mode)."""
        d, b = self.daemon, h.binding
        proc_root = d.config.proc_root
        if check_identity:
            try:
                verify_identity(b.pid, b.start_time, proc_root, pin=h.pin)
            except ProcessGone as exc:
                return Observation(gone="recycled" if exc.code == "pid_recycled" else "exited")
        looks = wanted(h.record())
        to_pin: list[tuple[int, str]] = []
        drifted: list[int] = []
        # first the cpuset: threads the kernel moved into a changed one are no one's drift
        news = self._cpuset_news(h)
        kernel_moved = news is not None and news.why == "cpuset_changed"
        if looks.threads and not kernel_moved:
            seen = self._look_at_threads(h, events)
            if seen is not None:  # None: the task list vanished; the next pass drops the worker
                to_pin, drifted = seen
            if drifted and news is None:  # the worker may have been moved to another cgroup
                news = self._cpuset_news(h, reopen=True)
        if news is not None and news.why == "cpuset_changed":
            to_pin, drifted = [], []
        moved = self._moved_irqs(h) if looks.irqs else []
        return Observation(
            to_pin=tuple(to_pin), drifted=tuple(drifted),
            evidence=read_evidence(b.pid, proc_root) if drifted else None,
            moved_irqs=tuple(moved),
            irqbalance_running=bool(moved) and bool(irqbalance_pids(proc_root)),
            cpuset=news,
        )

    def _look_at_threads(self, h, events: EventLook | None):
        b, proc_root = h.binding, self.daemon.config.proc_root
        roles = self._roles.get(b.pid)
        if roles is None or roles[0] is not b.plan:
            roles = self._roles[b.pid] = (b.plan, role_cpus(b.plan))
        first = self._looked.get(b.pid) is not h.threads  # bound (again) since the last look
        self._looked[b.pid] = h.threads
        classes = b.plan.thread_classes
        if events is None:
            return observe_threads(b.pid, h.threads, roles[1], self.passes, proc_root=proc_root, classes=classes)
        changes = events.changes
        if events.reread_all or first or b.pid in changes.resync or b.pid in events.reread:
            self._slots.pop(b.pid, None)
            return observe_threads(b.pid, h.threads, roles[1], self.passes, proc_root=proc_root, reread=True,
                                   classes=classes)
        if b.pid in events.listing:  # over its event budget: its events are dropped in the kernel
            self._slots.pop(b.pid, None)
            return observe_threads(b.pid, h.threads, roles[1], self.passes, proc_root=proc_root, classes=classes)
        look = changes.look.get(b.pid, ())
        if not look and slot_quiet(self._slot(h)):
            return [], []  # no news, and this pass's share of the masks is where we set it
        self._slots.pop(b.pid, None)  # the full look below may change the thread cache
        return observe_marked(b.pid, h.threads, roles[1], look, proc_root=proc_root, classes=classes)

    def _slot(self, h) -> Slot:
        """This pass's share of ``h``'s threads to check (observe.sweep_slots), from the
        slots kept since the thread cache last changed."""
        threads, passes = h.threads, self.daemon.config.drift_sweep_passes
        kept = self._slots.get(h.binding.pid)
        if kept is None or kept[0] is not threads or kept[1] != len(threads) or len(kept[2]) != passes:
            kept = self._slots[h.binding.pid] = (threads, len(threads), sweep_slots(h.binding.pid, threads, passes))
        return kept[2][self.passes % passes]

    def _memory_locality(self, held) -> None:
        """Due locality checks (and at most one memory-step rerun) start in the
        background: numa_maps walks and migratepages take seconds, this pass must not."""
        self.locality.tick(held=held)

    # ------------------------------------------------------------ IRQs

    def _moved_irqs(self, h) -> list[tuple[int, frozenset[int]]]:
        proc_root = self.daemon.config.proc_root
        moved = []
        for irq, cpus in _irq_targets(h.binding).items():
            text = read_irq_mask(irq, proc_root=proc_root)
            try:
                if text is not None and parse_mask(text) != cpus:
                    moved.append((irq, cpus))
            except ValueError:
                continue
        return moved

    def _irqs(self, h) -> bool:
        """Look at ``h``'s IRQ masks only, and act on what moved; True when the state changed."""
        moved = self._moved_irqs(h)
        if not moved:
            return False
        obs = Observation(moved_irqs=tuple(moved), irqbalance_running=bool(irqbalance_pids(self.daemon.config.proc_root)))
        record = h.record()
        return self.daemon.act(h, decide(record, obs, time.monotonic(), self.limits), window=self.window) \
            if wanted(record).irqs else False
