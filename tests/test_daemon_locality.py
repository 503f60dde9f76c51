"""Memory locality through the daemon.

* the rerun rule and the per-NPU aggregation as tables of plain values;
* the trigger on a two-NUMA-node host: the daemon's static facts come from a
  two-node snapshot of this machine's CPUs 0-1 (CI has one node), the worker is a
  real process bound for real, and its numa_maps is a fixture served through the
  daemon's HostSource (the only thing faked: this machine cannot put pages on a
  second node). The rerun it asks for is a real move job on the daemon's mover
  (pages really moving between nodes: tests/numa/, in a two-node guest);
* a real ``ascendbind serve``: the series appears for a bound worker with label
  npu="0", ``status`` shows the ratio, and the series goes when the worker is
  released or exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ascendbind.daemon.watch.lifecycle import memory_rerun_due
from ascendbind.values.reasons import Outcome, Step
from ascendbind.values.frozen import frozen_map
from ascendbind.settings import load_config
from ascendbind.daemon.api.auth import Peer
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.watch.held import Held
from ascendbind.daemon.watch.locality import MemoryLocality, ratios_by_npu
from ascendbind.daemon.api.metrics import Metrics
from ascendbind.values.model import Binding, DeviceType, Mode, NpuPlan, Plan
from tests.daemon_harness import ROOT, metric_value, running_daemon, wait_for
from tests.test_daemon_alignment_metrics import SplitSource, samples, two_node_host
from tests.workers import online_nodes, start_worker

# ---------------------------------------------------------------- the rerun rule


@pytest.mark.parametrize(
    ("ratio", "threshold", "last_run", "now", "interval", "futile", "due"),
    [
        (0.5, 0.8, 0.0, 600.0, 600.0, 0, True),
        (0.5, 0.8, 0.0, 599.9, 600.0, 0, False),  # rate limit: not before the interval
        (0.79, 0.8, 0.0, 1e6, 600.0, 0, True),
        (0.8, 0.8, 0.0, 1e6, 600.0, 0, False),  # at the threshold is local enough
        (0.99, 0.8, 0.0, 1e6, 600.0, 0, False),
        (None, 0.8, 0.0, 1e6, 600.0, 0, False),  # not measured / nothing resident: never
        (0.0, 0.0, 0.0, 1e6, 600.0, 0, False),  # threshold 0 turns reruns off
        (0.5, 0.8, 0.0, 1199.0, 600.0, 1, False),  # one futile rerun: twice the interval
        (0.5, 0.8, 0.0, 1200.0, 600.0, 1, True),
        (0.5, 0.8, 0.0, 4799.0, 600.0, 3, False),
        (0.5, 0.8, 0.0, 9599.0, 600.0, 40, False),  # the backoff stops at 16x
        (0.5, 0.8, 0.0, 9600.0, 600.0, 40, True),
        (0.5, 0.8, 100.0, 100.0, 0.0, 0, True),  # memory_rerun_seconds = 0: every check may rerun
    ],
)
def test_memory_rerun_due(ratio, threshold, last_run, now, interval, futile, due):
    assert memory_rerun_due(ratio, threshold, last_run, now, interval, futile) is due


def _held(pid: int, npus: tuple[int, ...], ratio: float | None) -> Held:
    plans = tuple(NpuPlan(n, (n,), (), (n,), (), (), (0,)) for n in npus)
    plan = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, tuple(npus), plans)
    h = Held(Binding(pid, 1, npus, plan, frozenset(npus), frozen_map(), ()), 0.0)
    h.memory_local_ratio = ratio
    return h


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        ([(10, (0,), 0.9)], {0: 0.9}),
        ([(10, (0, 1), 0.6)], {0: 0.6, 1: 0.6}),  # one worker driving two NPUs: each gets its ratio
        ([(10, (2,), 0.9), (11, (2,), 0.4)], {2: 0.4}),  # a shared NPU shows its worst worker
        ([(10, (0,), None), (11, (1,), 1.0)], {1: 1.0}),  # not measured: no sample
        ([], {}),
    ],
)
def test_ratios_by_npu(workers, expected):
    assert ratios_by_npu([_held(*w) for w in workers]) == expected


def test_the_gauge_exports_exactly_the_given_npus_and_labels_nothing_else():
    m = Metrics()
    m.memory_local({0: 0.5, 3: 1.0})
    text = m.render().decode()
    assert metric_value(text, "ascendbind_memory_local_ratio", npu="0") == 0.5
    assert metric_value(text, "ascendbind_memory_local_ratio", npu="3") == 1.0
    m.memory_local({3: 0.25})
    text = m.render().decode()
    assert metric_value(text, "ascendbind_memory_local_ratio", npu="0") is None
    assert metric_value(text, "ascendbind_memory_local_ratio", npu="3") == 0.25
    series = [ln for ln in text.splitlines() if ln.startswith("ascendbind_memory_local_ratio{")]
    assert series == ['ascendbind_memory_local_ratio{npu="3"} 0.25']
    m.memory_local({})
    assert "ascendbind_memory_local_ratio{" not in m.render().decode()


# ---------------------------------------------------------------- the trigger, on a two-node host

needs_cpus_0_1 = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")


class FixtureNumaMaps(SplitSource):
    """SplitSource, with each worker's numa_maps read from the snapshot directory."""

    def read(self, path, limit=None):
        if path.startswith("/proc/") and path.endswith("/numa_maps"):
            return self.snap.read(path, limit=limit)
        return super().read(path, limit=limit)


def _numa_maps(directory, pid: int, node0: int, node1: int) -> None:
    """A worker's numa_maps with ``node0`` / ``node1`` pages (4 KiB) of heap on nodes 0 / 1."""
    path = os.path.join(directory, "proc", str(pid), "numa_maps")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = ["55d0c0a00000 default file=/usr/bin/python3.11 mapped=4 mapmax=2 N1=4 kernelpagesize_kB=4",
             f"55d0c1000000 default heap anon={node0 + node1} dirty={node0 + node1} "
             + (f"N0={node0} " if node0 else "") + (f"N1={node1} " if node1 else "") + "kernelpagesize_kB=4",
             "7ffd00000000 default stack anon=4 dirty=4 N1=4 kernelpagesize_kB=4"]
    with open(path + ".tmp", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def _gauge(daemon, npu: str):
    return samples(daemon).get(("ascendbind_memory_local_ratio", (("npu", npu),)))


def _finished(job):
    assert job is not None and job.finished.wait(60), "the move job did not end"
    return job


def _checks(daemon, result="measured") -> float:
    return samples(daemon).get(("ascendbind_memory_checks_total", (("result", result),)), 0.0)


@needs_cpus_0_1
def test_low_locality_reruns_the_memory_step_rate_limited_with_backoff(tmp_path):
    host = str(tmp_path / "host")
    two_node_host(host)
    config = load_config(None, env={}, overrides={"small_pool": "share", "irq_binding": "false"}).replace(
        state_dir=str(tmp_path / "state"), memory_rerun_seconds=600.0, memory_local_threshold=0.8,
        memory_check_seconds=60.0)  # checks every minute: the reruns' own rate limit is what is tested
    daemon = Daemon(config, source=FixtureNumaMaps(host))
    locality = daemon.locality
    root = Peer(pid=os.getpid(), uid=0, gid=0)
    with start_worker(plain=1, acl=0, release=0) as w:
        try:
            # 3/4 of the heap on node 0, while NPU1's pool (CPU 1) is on node 1
            _numa_maps(host, w.pid, node0=1200, node1=392)
            result = daemon.bind_request(root, {"pid": w.pid, "npu": 1})
            assert result["plan"]["npus"]["1"]["numa_nodes"] == [1]
            # two nodes: the answer came before the move, which is the mover's job now
            (memory,) = [s for s in result["steps"] if s["step"] == "memory"]
            assert memory["outcome"] == "pending" and memory["data"]["target_node"] == 1
            h = daemon.held[w.pid]
            # the move ends, is recorded, and the locality right after it is measured
            assert wait_for(lambda: h.memory_move is None and h.memory_local_ratio is not None, 60)
            assert h.binding.step(Step.MEMORY).outcome is Outcome.APPLIED
            t0 = h.memory_last_run  # the bind started the memory step: that is the last run
            # of the private memory only (heap and stack): the python text is shared
            low = (392 + 4) / (1200 + 392 + 4)
            assert h.memory_local_ratio == pytest.approx(low)  # measured once the move ended

            # a check: measured and exported, but not run again yet
            assert locality.due(t0 + 100) == [h]
            assert locality.run_round(locality.due(t0 + 100), now=t0 + 100) is None
            assert h.memory_local_ratio == pytest.approx(low)
            assert _gauge(daemon, "1") == pytest.approx(low)
            doc = daemon.workers()["workers"][0]
            assert doc["memory_local_ratio"] == round(low, 4)
            assert doc["memory_kib_by_node"] == {"private": {"0": 4800, "1": 1584}, "shared": {"1": 16}}
            assert doc["memory"]["state"] == "done" and doc["memory"]["target_node"] == 1
            assert locality.due(t0 + 101) == []  # checked: the next check is memory_check_seconds away

            # one rerun interval later: a move job to the node of pool[0], not waited for
            t1 = t0 + 601
            measured = _checks(daemon)
            rerun = _finished(locality.run_round(locality.due(t1), now=t1))
            assert rerun.node == 1 and rerun.why == "rerun" and rerun.ratio_before == pytest.approx(low)
            assert rerun.result is not None and rerun.result.outcome is Outcome.APPLIED, rerun.result
            assert h.memory_reruns == 1 and h.memory_futile == 1  # the ratio did not rise: futile
            s = samples(daemon)
            assert s[("ascendbind_memory_reruns_total", (("outcome", "applied"),))] == 1
            assert _checks(daemon) == measured + 2  # the round's, and the one right after the move

            # it did not help: the next rerun waits twice the interval
            assert locality.run_round(locality.due(t1 + 1100), now=t1 + 1100) is None
            _finished(locality.run_round(locality.due(t1 + 1201), now=t1 + 1201))
            assert h.memory_reruns == 2 and h.memory_futile == 2

            # the memory is local now: the ratio recovers, the backoff resets, nothing runs
            _numa_maps(host, w.pid, node0=0, node1=1592)
            t2 = t1 + 1e5
            assert locality.run_round(locality.due(t2), now=t2) is None
            assert h.memory_local_ratio == 1.0 and h.memory_futile == 0 and _gauge(daemon, "1") == 1.0
            assert daemon.workers()["workers"][0]["memory_reruns"] == 2

            # a malformed numa_maps: counted, no ratio, no sample (never a stale one)
            with open(os.path.join(host, "proc", str(w.pid), "numa_maps"), "a") as fh:
                fh.write("7fff00000000 default N1=oops kernelpagesize_kB=4\n")
            assert locality.run_round(locality.due(t2 + 100), now=t2 + 100) is None
            assert h.memory_local_ratio is None and _gauge(daemon, "1") is None
            assert _checks(daemon, "malformed") == 1

            # longer than the read limit (a worker's owner can make it so): not held, counted
            locality.numa_maps_limit = 100
            _numa_maps(host, w.pid, node0=0, node1=1592)
            assert locality.run_round(locality.due(t2 + 200), now=t2 + 200) is None
            assert h.memory_local_ratio is None and _gauge(daemon, "1") is None
            assert _checks(daemon, "too_large") == 1
            locality.numa_maps_limit = MemoryLocality(daemon).numa_maps_limit

            # switched off (memory_check_seconds = 0): no round starts, no series stays
            _numa_maps(host, w.pid, node0=0, node1=1592)
            locality.run_round(locality.due(t2 + 300), now=t2 + 300)
            assert _gauge(daemon, "1") == 1.0
            daemon.config = daemon.config.replace(memory_check_seconds=0.0)
            assert locality.tick() is False
            assert _gauge(daemon, "1") is None and h.memory_local_ratio is None
            daemon.config = daemon.config.replace(memory_check_seconds=60.0)
            locality.run_round(locality.due(t2 + 400), now=t2 + 400)
            assert _gauge(daemon, "1") == 1.0
        finally:
            if w.pid in daemon.held:
                daemon.release_pid(w.pid)
            daemon.close()
    assert _gauge(daemon, "1") is None, "a released worker's series goes with it"


# ---------------------------------------------------------------- a real daemon


def _cli(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ascendbind.cli", *args], capture_output=True, text=True,
                          env=d.env, cwd=str(ROOT), timeout=60)


def _ratio(d) -> float | None:
    return metric_value(d.metrics_text(), "ascendbind_memory_local_ratio", npu="0")


def test_the_daemon_exports_locality_per_npu_and_drops_it_with_the_worker(tmp_path):
    one_node = len(online_nodes()) == 1
    with running_daemon(str(tmp_path), ASCENDBIND_MEMORY_CHECK_SECONDS="1") as d:
        d.wait_discovered()
        with start_worker(plain=1, acl=0, release=0) as w:
            status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
            assert status == 200, body
            assert wait_for(lambda: _ratio(d) is not None, 20), d.log()[-3000:]
            text = d.metrics_text()
            ratio = metric_value(text, "ascendbind_memory_local_ratio", npu="0")
            assert 0.0 <= ratio <= 1.0 and (ratio == 1.0 or not one_node)
            assert [ln.partition(" ")[0] for ln in text.splitlines()
                    if ln.startswith("ascendbind_memory_local_ratio{")] == ['ascendbind_memory_local_ratio{npu="0"}']
            assert metric_value(text, "ascendbind_memory_checks_total", result="measured") >= 1
            if one_node:  # all memory is local: nothing is ever run again
                assert sum(metric_value(text, "ascendbind_memory_reruns_total", outcome=o)
                           for o in ("applied", "skipped", "failed")) == 0

            r = _cli(d, "status", "--format", "json")
            assert r.returncode == 0, r.stderr
            (doc,) = json.loads(r.stdout)["workers"]
            assert doc["pid"] == w.pid and doc["memory_local_ratio"] == pytest.approx(ratio, abs=1e-4)
            table = _cli(d, "status").stdout
            assert "MEM-LOCAL" in table and (not one_node or "100%" in table), table
            # a one-node host has nowhere to move pages: the step was skipped at the bind
            assert "MEM-MOVE" in table and (not one_node or "skipped (single_numa_node)" in table), table

            d.client.release(w.pid)
            assert _ratio(d) is None, "released: the series goes at once"

            # bound again, then the worker exits: the reconcile pass drops it and its series
            assert d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})[0] == 200
            assert wait_for(lambda: _ratio(d) is not None, 20), d.log()[-3000:]
        assert wait_for(lambda: _ratio(d) is None, 20), d.log()[-3000:]
        assert d.client.workers()["workers"] == []
        assert d.alive()


def test_status_memory_still_lists_pages_per_node(tmp_path):
    with running_daemon(str(tmp_path)) as d:
        d.wait_discovered()
        with start_worker(plain=0, acl=0, release=0) as w:
            assert d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})[0] == 200
            r = _cli(d, "status", "--memory", "--format", "json")
            assert r.returncode == 0, r.stderr
            pages = json.loads(r.stdout)["workers"][0]["memory_pages_by_node"]
            assert pages and set(pages) <= {str(n) for n in online_nodes()} and all(v > 0 for v in pages.values())
            d.client.release(w.pid)

