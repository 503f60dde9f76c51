"""Thread classes, the pure part: the config key's checks, the carving of shares of main,
which class a thread name falls in, and the plan a snapshot host gets with classes (the
live bind and the late threads: test_thread_classes_live.py)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from ascendbind.applier.affinity import cpus_for_role, role_of, targets_of
from ascendbind.applier.bind import merge_npu_plans
from ascendbind.daemon.state.staterecord import binding_from_json, binding_to_json
from ascendbind.errors import ConfigError
from ascendbind.planner.pools.roles import class_cpus, split_roles
from ascendbind.settings import load_config
from ascendbind.values.config import Config, from_layers
from ascendbind.values.model import Binding, DeviceType, Mode, NpuPlan, Plan
from ascendbind.values.threadclass import MAX_CLASSES, ThreadClass, carve, parse_thread_classes
from tests.golden import all_cases, run_plan

HALF, ONE = Fraction(1, 2), Fraction(1)
SECOND_HALF = (HALF, ONE)
LAST_QUARTER = (Fraction(3, 4), ONE)
FIRST_HALF = (Fraction(0), HALF)

UCM = {"name": "ucm", "match": ["ucm_*"], "share": "second-half"}


def classes(*rows):
    return parse_thread_classes(list(rows))


# ---------------------------------------------------------------- carving


@pytest.mark.parametrize("n, second_half, last_quarter, first_half", [
    (1, [0], [0], [0]),  # one main CPU: every share is all of main
    (2, [1], [1], [0]),
    (3, [1, 2], [2], [0]),
    (4, [2, 3], [3], [0, 1]),
    (5, [2, 3, 4], [3, 4], [0, 1]),
    (8, [4, 5, 6, 7], [6, 7], [0, 1, 2, 3]),
    (12, list(range(6, 12)), [9, 10, 11], list(range(6))),
])
def test_shares_of_a_main_of_n_cpus(n, second_half, last_quarter, first_half):
    main = tuple(range(100, 100 + n))
    assert carve(main, SECOND_HALF) == tuple(100 + i for i in second_half)
    assert carve(main, LAST_QUARTER) == tuple(100 + i for i in last_quarter)
    assert carve(main, FIRST_HALF) == tuple(100 + i for i in first_half)


@pytest.mark.parametrize("n", range(1, 41))
def test_the_two_halves_never_overlap_and_cover_main_from_two_cpus_on(n):
    main = tuple(range(n))
    first, second = set(carve(main, FIRST_HALF)), set(carve(main, SECOND_HALF))
    assert first and second and first | second == set(main)
    assert (first & second) == (set(main) if n == 1 else set())
    assert set(carve(main, LAST_QUARTER)) <= second  # the last quarter lies in the second half


def test_a_share_is_cut_by_position_in_sorted_main_and_never_empty():
    main = (7, 3, 40, 12)  # positions follow the sorted CPUs, not the order given
    assert carve(main, SECOND_HALF) == (12, 40)
    assert carve(main, (Fraction(0), Fraction(1, 100))) == (3,)  # rounds to none: the CPU where it starts
    assert carve(main, (Fraction(99, 100), ONE)) == (40,)  # at the end: the last CPU
    assert carve((), SECOND_HALF) == ()


def test_classes_are_carved_from_the_whole_main_each_on_its_own_in_config_order():
    rows = classes(UCM, {"name": "tail", "match": "t_*", "share": "last-quarter"},
                   {"name": "hccl", "match": "hccl*", "role": "acl"},
                   {"name": "mid", "match": "m_*", "share": ["1/4", "3/4"]})
    main = tuple(range(10, 18))
    assert class_cpus(main, rows) == (("ucm", (14, 15, 16, 17)), ("tail", (16, 17)), ("mid", (12, 13, 14, 15)))
    assert class_cpus((5,), rows) == (("ucm", (5,)), ("tail", (5,)), ("mid", (5,)))


def test_the_role_split_is_the_same_with_classes_configured():
    pool = tuple(range(16))
    plain = split_roles(pool, Config())
    assert split_roles(pool, Config(thread_classes=[UCM])) == plain
    assert class_cpus(plain.main, classes(UCM)) == (("ucm", tuple(range(8, 14))),)


# ---------------------------------------------------------------- names


def test_first_matching_class_wins_then_the_built_in_rules():
    rows = classes({"name": "hccl", "match": ["hccl*", "hcom_*"], "role": "release"}, UCM,
                   {"name": "wide", "match": "*_0", "share": "first-half"},
                   {"name": "quiet_acl", "match": "acl_thread_9", "role": "main"})
    assert role_of("hccl_send", rows) == "release"
    assert role_of("hcom_x", rows) == "release"
    assert role_of("ucm_store_0", rows) == "ucm"  # matches ucm and wide: the first listed wins
    assert role_of("worker_0", rows) == "wide"
    assert role_of("acl_thread", rows) == "acl"  # no class: the built-in rule
    assert role_of("acl_thread_9", rows) == "main"  # a class overrides a built-in rule
    assert role_of("release_thread", rows) == "release"
    assert role_of("python3", rows) == "main"
    assert role_of("UCM_store", rows) == "main"  # case sensitive, as the kernel's names are
    assert targets_of(rows) == ("main", "acl", "release", "ucm", "wide")


def test_without_classes_the_roles_are_the_built_in_rules():
    for comm, role in (("acl_thread", "acl"), ("acl_thread_2", "acl"), ("release_thread", "release"),
                       ("release_thread1", "release"), ("ucm_store", "main"), ("worker_0", "main")):
        assert role_of(comm) == role == role_of(comm, ())
    assert targets_of(()) == ("main", "acl", "release")


def test_a_class_takes_its_own_cpus_and_the_merged_plan_their_union():
    a = NpuPlan(0, tuple(range(0, 8)), (0, 1), tuple(range(2, 6)), (6,), (7,), (0,), classes=(("ucm", (4, 5)),))
    b = NpuPlan(1, tuple(range(8, 16)), (8, 9), tuple(range(10, 14)), (14,), (15,), (0,), classes=(("ucm", (12, 13)),))
    assert cpus_for_role(a, "ucm", Mode.TOPO_AFFINITY) == {4, 5}
    assert cpus_for_role(a, "ucm", Mode.ASCEND950_CLUSTER) == set(range(8))
    with pytest.raises(ValueError, match="unknown thread role 'tail'"):
        cpus_for_role(a, "tail", Mode.TOPO_AFFINITY)
    merged = merge_npu_plans((a, b))
    assert merged.classes == (("ucm", (4, 5, 12, 13)),)


# ---------------------------------------------------------------- the config key


def test_the_key_loads_from_toml_the_environment_and_a_flag(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[[thread_classes]]\nname = "ucm"\nmatch = ["ucm_*"]\nshare = "second-half"\n'
                 '[[thread_classes]]\nname = "hccl"\nmatch = "hccl*"\nrole = "acl"\n'
                 '[[thread_classes]]\nname = "tail"\nmatch = ["t_*", "u?"]\nshare = ["3/4", 1]\n')
    want = (ThreadClass("ucm", ("ucm_*",), share=SECOND_HALF), ThreadClass("hccl", ("hccl*",), role="acl"),
            ThreadClass("tail", ("t_*", "u?"), share=LAST_QUARTER))
    assert load_config(str(f), env={}).thread_classes == want
    text = "ucm:ucm_*:second-half; hccl:hccl*:acl ;tail:t_*,u?:1/4"
    assert load_config(None, env={"ASCENDBIND_CONFIG": "", "ASCENDBIND_THREAD_CLASSES": text}).thread_classes == want
    assert load_config(None, env={"ASCENDBIND_CONFIG": ""}, overrides={"thread_classes": text}).thread_classes == want
    assert Config().thread_classes == () and Config(thread_classes="").thread_classes == ()


@pytest.mark.parametrize("value, message", [
    ([{"name": "ucm", "match": ["ucm_*"]}], "class 'ucm': give exactly one of role"),
    ([{"name": "ucm", "match": ["ucm_*"], "role": "acl", "share": "all"}], "give exactly one of role"),
    ([{"name": "ucm", "match": "ucm_*", "role": "irq"}], "role must be one of main, acl, release; got 'irq'"),
    ([{"name": "main", "match": "x", "role": "acl"}], "class 1: name 'main' must be"),
    ([{"name": "Ucm", "match": "x", "role": "acl"}], "class 1: name 'Ucm' must be 1 to 24 of a-z"),
    ([{"name": "a" * 25, "match": "x", "role": "acl"}], "must be 1 to 24"),
    ([UCM, dict(UCM)], "class 2: name 'ucm' is used twice"),
    ([{"name": "ucm", "match": [], "share": "all"}], "match must be a pattern or a non-empty list"),
    ([{"name": "ucm", "match": ["x"] * 9, "share": "all"}], "9 patterns; at most 8"),
    ([{"name": "ucm", "match": ["x" * 33], "share": "all"}], "must be 1 to 32 printable ASCII"),
    ([{"name": "ucm", "match": ["ucm\n*"], "share": "all"}], "must be 1 to 32 printable ASCII"),
    ([{"name": "ucm", "match": "x", "share": "third-half"}], "share must be one of all, first-half"),
    ([{"name": "ucm", "match": "x", "share": 0}], "0 <= from < to <= 1; got 1 to 1"),
    ([{"name": "ucm", "match": "x", "share": "3/2"}], "must be from 0 to 1"),
    ([{"name": "ucm", "match": "x", "share": ["1/2", "1/4"]}], "0 <= from < to <= 1; got 1/2 to 1/4"),
    ([{"name": "ucm", "match": "x", "share": ["1/2"]}], "takes two fractions; got 1"),
    ([{"name": "ucm", "match": "x", "share": "1/3000"}], "denominator of at most 1024"),
    ([{"name": "ucm", "match": "x", "share": True}], "share must be one of"),
    ([{"name": "ucm", "match": "x", "share": "all", "cpus": "0-3"}], "unknown field 'cpus'"),
    (["ucm"], "class 1: expected a table"),
    ([{"name": f"c{i}", "match": "x", "role": "main"} for i in range(MAX_CLASSES + 1)], "17 classes; at most 16"),
    ({"name": "ucm"}, "expected an array of tables"),
    ("ucm:ucm_*", "is not name:pattern[,pattern]:target"),
])
def test_a_bad_value_is_an_error_naming_the_key_and_the_class(value, message):
    with pytest.raises(ConfigError) as err:
        from_layers([("config file /etc/x.toml", {"thread_classes": value})])
    assert str(err.value).startswith("config file /etc/x.toml: key 'thread_classes': ")
    assert message in str(err.value)


def test_a_bad_value_in_the_file_names_the_file_and_the_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[[thread_classes]]\nname = "ucm"\nmatch = "ucm_*"\nshare = "half"\n')
    with pytest.raises(ConfigError, match=rf"config file {f}: key 'thread_classes': class 'ucm': share must be"):
        load_config(str(f), env={})


# ---------------------------------------------------------------- plans


def test_no_plan_without_classes_carries_a_class_key():
    # the golden tests hold every plan to its file; this one says why they still pass
    plans = [run_plan(host, argv)[1] for host, _case, argv in all_cases()]
    assert any(plans)
    for plan in filter(None, plans):
        assert "thread_classes" not in plan and not any("classes" in p for p in plan["npus"].values())


def test_a_plan_with_classes_keeps_every_role_and_adds_the_classes():
    argv = ["--npu", "3"]
    _, plain, _ = run_plan("a2-8x910b3", argv)
    _, plan, err = run_plan("a2-8x910b3", argv + ["--thread-classes", "ucm:ucm_*:second-half;hccl:hccl*:acl"])
    assert plan is not None, err
    npu = plan["npus"]["3"]
    main = npu["main"]
    assert len(main) >= 4
    assert npu.pop("classes") == {"ucm": main[len(main) // 2:]}
    assert plan.pop("thread_classes") == [{"name": "ucm", "match": ["ucm_*"], "share": ["1/2", "1"]},
                                          {"name": "hccl", "match": ["hccl*"], "role": "acl"}]
    assert plan == plain


def test_an_ascend950_plan_carves_nothing():
    _, plan, err = run_plan("950-4numa", ["--npu", "0", "--thread-classes", "ucm:ucm_*:second-half"])
    assert plan is not None, err
    assert "classes" not in plan["npus"]["0"] and plan["thread_classes"][0]["name"] == "ucm"


def test_the_plan_and_the_state_record_keep_the_classes():
    rows = classes(UCM, {"name": "hccl", "match": "hccl*", "role": "release"})
    npu = NpuPlan(0, tuple(range(8)), (0, 1), tuple(range(2, 6)), (6,), (7,), (0,), classes=(("ucm", (4, 5)),))
    plan = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, tuple(range(8)), (npu,), thread_classes=rows)
    assert Plan.from_json(plan.to_json()) == plan
    binding = Binding(pid=1234, start_time=5, npus=(0,), plan=plan, original_cpus=frozenset(range(8)),
                      saved_irq_masks={}, steps=())
    again = binding_from_json(json.loads(json.dumps(binding_to_json(binding))))
    assert again.plan.thread_classes == rows and again.plan.npus[0].classes == (("ucm", (4, 5)),)
