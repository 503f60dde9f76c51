"""The role split and target selection."""

import pytest

from ascendbind.config import Config
from ascendbind.errors import PlanImpossible
from ascendbind.model import NpuProcess
from ascendbind.planner import select_targets
from ascendbind.planner.roles import RoleSplitError, role_minimum, split_roles
from tests.planner_hosts import a2_host, a3_host, worker


def r(lo, hi):
    return tuple(range(lo, hi + 1))


def roles(pool, **cfg):
    x = split_roles(pool, Config(**cfg))
    return x.irq, x.main, x.acl, x.release


def test_default_split_reserves_two_irq_cpus():
    assert roles(r(0, 39)) == ((0, 1), r(2, 37), (38,), (39,))


def test_default_minimum_is_5():
    assert roles(r(10, 14)) == ((10, 11), (12,), (13,), (14,))
    with pytest.raises(RoleSplitError, match="4 CPUs, below the role minimum of 5"):
        roles(r(10, 13))


def test_without_irq_binding_main_takes_the_irq_cpus():
    assert roles(r(0, 9), irq_binding=False) == ((), r(0, 7), (8,), (9,))
    assert roles((4, 5, 6), irq_binding=False) == ((), (4,), (5,), (6,))
    with pytest.raises(RoleSplitError, match="minimum of 3"):
        roles((4, 5), irq_binding=False)


def test_share_applies_only_below_the_minimum():
    assert roles(r(0, 9), small_pool="share") == roles(r(0, 9))
    assert roles((7, 8, 9, 10), small_pool="share") == ((7,), (7, 8, 9), (10,), (10,))
    assert roles((7, 8), small_pool="share") == ((7,), (7,), (8,), (8,))
    assert roles((7,), small_pool="share") == ((7,), (7,), (7,), (7,))


def test_share_without_irq_binding_keeps_irq_empty():
    assert roles((7, 8), small_pool="share", irq_binding=False) == ((), (7,), (8,), (8,))
    assert roles((7,), small_pool="share", irq_binding=False) == ((), (7,), (7,), (7,))


def test_ascend950_main_is_the_whole_cluster():
    x = split_roles(r(16, 31), Config(), ascend950=True)
    assert (x.irq, x.main, x.acl, x.release) == ((), r(16, 31), (), ())


def test_role_minimum():
    assert role_minimum(Config()) == 5
    assert role_minimum(Config(irq_binding=False)) == 3
    assert role_minimum(Config(small_pool="share")) == 1


# ---------------------------------------------------------------- targets


def test_requested_targets_are_sorted_and_deduplicated():
    assert select_targets(a2_host(), worker(range(192)), [3, 1, 3]) == (1, 3)


def test_targets_from_the_process_table():
    h = a2_host(processes=(NpuProcess(npu=5, pid=77, name="vllm"), NpuProcess(npu=2, pid=42, name="x"),
                           NpuProcess(npu=4, pid=77, name="vllm")))
    assert select_targets(h, worker(range(192), pid=77), None) == (4, 5)


def test_targets_from_visible_devices_filter_running_npus():
    h = a2_host(processes=(NpuProcess(npu=5, pid=77, name="vllm"), NpuProcess(npu=2, pid=42, name="x")))
    w = worker(range(192), pid=1000, env={"ASCEND_RT_VISIBLE_DEVICES": "2, 3"})
    assert select_targets(h, w, None) == (2,)


def test_no_target_says_what_it_tried():
    h = a2_host(processes=(NpuProcess(npu=5, pid=77, name="vllm"),))
    with pytest.raises(PlanImpossible) as exc:
        select_targets(h, worker(range(192), pid=1000), None)
    assert exc.value.code == "no_target_npu"
    assert "process table" in str(exc.value) and "ASCEND_RT_VISIBLE_DEVICES" in str(exc.value)
    with pytest.raises(PlanImpossible, match="running: 5"):
        select_targets(h, worker(range(192), pid=1000, env={"ASCEND_RT_VISIBLE_DEVICES": "0"}), None)


def test_malformed_visible_devices_is_named():
    with pytest.raises(PlanImpossible, match="'0,x'"):
        select_targets(a3_host(), worker(range(640), env={"ASCEND_RT_VISIBLE_DEVICES": "0,x"}), None)


def test_requested_ids_unchecked_when_the_host_lists_no_chips():
    h = a2_host()
    from dataclasses import replace

    assert select_targets(replace(h, chips=()), worker(range(192)), [12]) == (12,)
    with pytest.raises(PlanImpossible):
        select_targets(replace(h, chips=()), worker(range(192)), [-1])
