"""The role split (target selection: test_targets_rule.py)."""

import pytest

from ascendbind.values.config import Config
from ascendbind.planner.pools.roles import RoleSplitError, role_minimum, split_roles


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


