"""The memory step: a real migratepages call and the skip reasons."""

from __future__ import annotations

import os
import shutil

import pytest

from ascendbind.applier.memory import migrate_memory, run_migratepages
from ascendbind.config import Config
from ascendbind.model import (
    DeviceType,
    HostFacts,
    Mode,
    NpuPlan,
    Outcome,
    Plan,
    Reason,
)
from tests.planner_hosts import one_npu_host
from tests.workers import start_worker

needs_migratepages = pytest.mark.skipif(shutil.which("migratepages") is None, reason="numactl not installed")


def host(nodes: dict[int, frozenset[int]]) -> HostFacts:
    return one_npu_host(nodes)


def plan(pool=(2, 3, 4, 5, 6)) -> Plan:
    return Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, pool, (NpuPlan(0, pool, pool[:2], pool[2:-2], pool[-2:-1], pool[-1:], (0,)),))


@needs_migratepages
def test_real_migratepages_node0_to_node0_through_the_command_path():
    with start_worker(plain=0, acl=0, release=0) as w:
        res = run_migratepages(w.pid, [0], 0)
        assert res.outcome is Outcome.APPLIED, res.detail
        assert res.data["exit_status"] == 0
        assert res.data["argv"] == [str(w.pid), "0", "0"]


@needs_migratepages
def test_migratepages_failure_is_failed_with_stderr():
    with start_worker(plain=0, acl=0, release=0) as w:
        pid = w.pid
    res = run_migratepages(pid, [0], 0)  # the pid no longer exists
    assert res.outcome is Outcome.FAILED and res.reason is Reason.MIGRATEPAGES_FAILED
    assert "exited" in res.detail and res.data["exit_status"] != 0


def test_single_numa_node_host_skips():
    res = migrate_memory(plan(), os.getpid(), host({0: frozenset(range(8))}), Config())
    assert res.outcome is Outcome.SKIPPED and res.reason is Reason.SINGLE_NUMA_NODE


def test_no_numa_info_skips():
    res = migrate_memory(plan(), os.getpid(), host({}), Config())
    assert res.reason is Reason.NO_NUMA_INFO


def test_missing_tool_skips(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no migratepages anywhere
    res = migrate_memory(plan(), os.getpid(), host({0: frozenset(range(4)), 1: frozenset(range(4, 8))}), Config())
    assert res.outcome is Outcome.SKIPPED and res.reason is Reason.MIGRATEPAGES_MISSING


@needs_migratepages
def test_two_node_plan_targets_the_node_of_pool0():
    # pool[0] = CPU 5 on node 1 of a (described) two-node host; this machine has one
    # node, so the real migratepages refuses node 1 and the step reports it
    facts = host({0: frozenset(range(4)), 1: frozenset(range(4, 8))})
    with start_worker(plain=0, acl=0, release=0) as w:
        res = migrate_memory(plan(pool=(5, 6, 7, 4, 3)), w.pid, facts, Config())
    assert res.data["argv"][1:] == ["0,1", "1"]
    assert res.data["target_node"] == 1
    if not os.path.exists("/sys/devices/system/node/node1"):
        assert res.outcome is Outcome.FAILED and res.reason is Reason.MIGRATEPAGES_FAILED
