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
import json
import os
import random
import signal
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_harness import PATIENCE, DaemonProc, base_env, free_port, metric_value, wait_for
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
    d.start()
    d.wait_discovered()
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
                assert rec["in_flight"] is True and rec["original_cpus"] == _cpulist(CPUS)
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


def _cpulist(cpus) -> str:
    from ascendbind.values.cpulist import format_cpulist

    return format_cpulist(cpus)
