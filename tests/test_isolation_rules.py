"""Isolation's pure rules, as tables: the housekeeping set of the fixture hosts (kubelet
style: a topology and the bound NPUs in, the sets out), ``narrowed``, the driver's
per-device names, what one mask gets (``mask_act``), the record kept in the state
file, the config keys, and that no level changes a plan."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from ascendbind.values.config import Config, exempt_entries
from ascendbind.values.cpulist import format_cpulist, parse_cpulist
from ascendbind.daemon.isolate.rules.keys import MaskKey
from ascendbind.daemon.isolate.rules.records import (DefaultSaved, IrqSaved, IsolationRecord, SavedBan, TaskSaved,
                                                     WorkqueueSaved)
from ascendbind.daemon.isolate.rules.verdicts import Act, irq_target, mask_act
from ascendbind.daemon.state.state import StateFile
from ascendbind.discovery import discover_host, discover_worker
from ascendbind.discovery.parse.irqbalance import auto_banned_cpus, cpus_command
from ascendbind.discovery.read.sources import SnapshotHost
from ascendbind.errors import ConfigError
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import DeviceType, NpuChip
from ascendbind.planner import make_plan
from ascendbind.planner.isolate.driverwork import (device_id, driver_cpus, sq_send_wq_device, sq_send_wq_name,
                                          sq_task_device, trs_mbox_device)
from ascendbind.planner.isolate.isolation import NO_HOUSEKEEPING, explain_isolation, narrowed, plan_isolation, task_target
from ascendbind.settings import load_config
from tests.golden import CASES, HOSTS, golden_path, run_plan
from tests.planner_hosts import host, one_npu_host, worker


def fixture_plans(name: str, npus, **config):
    src = SnapshotHost(os.path.join(HOSTS, name))
    cfg = Config(**config)
    facts = discover_host(src, cfg)
    w = discover_worker(src, None, cfg)
    return facts, [make_plan(facts, w, [n], cfg) for n in npus], cfg


def pairs(start: int, step: int, count: int) -> str:
    """CPUs start, start+1, start+step, start+step+1, …: each pool's two IRQ CPUs."""
    return format_cpulist(c for k in range(count) for c in (start + k * step, start + k * step + 1))


# ---------------------------------------------------------------- housekeeping, host by host

HOUSEKEEPING = [
    # host, bound NPUs, config, housekeeping, protected, error
    ("a3-16die", [5], {}, pairs(0, 40, 16), "202-239", None),
    ("a3-16die", [5, 9], {}, pairs(0, 40, 16), "202-239,362-399", None),
    ("a3-16die", [], {}, pairs(0, 40, 16), "", None),
    ("a2-8x910b3", [3], {}, pairs(0, 24, 8), "122-143", None),
    ("a2-8x910b3", [0, 3], {}, pairs(0, 24, 8), "122-143,146-167", None),
    ("310p-4card", [5], {}, pairs(0, 8, 8), "42-47", None),
    # Ascend 950: no IRQ CPUs, the whole pool is main; what no cluster covers (UVB pool included)
    ("950-4numa", [3], {}, "16-39,56-79,96-119,136-159", "48-55", None),
    ("950-4numa", [0, 5], {}, "16-39,56-79,96-119,136-159", "0-7,88-95", None),
    # every CPU in some pool and no IRQ CPU reserved: nothing is left
    ("a2-8x910b3", [3], {"irq_binding": False}, "", "120-141,142,143", NO_HOUSEKEEPING),
    # named by the operator: taken as given, less what is bound
    ("a2-8x910b3", [3], {"housekeeping_cpus": "0-3,122-125"}, "0-3", "122-143", None),
    ("a3-16die", [5], {"housekeeping_cpus": "200-203"}, "200-201", "202-239", None),
    ("a3-16die", [5], {"housekeeping_cpus": "202-239"}, "", "202-239", NO_HOUSEKEEPING),
]


@pytest.mark.parametrize("name, npus, config, housekeeping, protected, error", HOUSEKEEPING)
def test_housekeeping_of_the_fixture_hosts(name, npus, config, housekeeping, protected, error):
    facts, plans, cfg = fixture_plans(name, npus, isolation="irqs", **config)
    iso = plan_isolation(facts, plans, cfg)
    assert iso.housekeeping == parse_cpulist(housekeeping)
    assert iso.protected_cpus == parse_cpulist(protected)
    assert (iso.error.code if iso.error else None) == error
    # a worker's main, ACL and release CPUs are never housekeeping, however the set is named
    for plan in plans:
        for p in plan.npus:
            roles = p.pool if facts.device_type is DeviceType.A950 else p.main + p.acl + p.release
            assert not set(roles) & iso.housekeeping
    assert iso.source == ("auto" if "housekeeping_cpus" not in config else "config")


def test_auto_on_a3_is_the_pools_irq_cpus_exactly():
    """Every CPU of the A3 host is in some NPU's global_slice pool: auto takes each pool's
    two IRQ CPUs and nothing else (32 of 640)."""
    facts, plans, cfg = fixture_plans("a3-16die", [5])
    whole = make_plan(facts, worker(range(640)), list(range(16)), cfg)
    assert sorted(c for p in whole.npus for c in p.pool) == list(range(640))
    iso = plan_isolation(facts, plans, cfg)
    assert iso.housekeeping == frozenset(c for p in whole.npus for c in p.irq) and len(iso.housekeeping) == 32


def test_an_explicit_list_that_overlaps_the_bound_cpus_loses_them_with_a_warning():
    facts, plans, cfg = fixture_plans("a2-8x910b3", [3], housekeeping_cpus="0-3,122-125,900")
    iso = plan_isolation(facts, plans, cfg)
    assert iso.housekeeping == frozenset(range(4))
    said = " ".join(iso.warnings)
    assert "122-125" in said and "NPU 3 main" in said and "900" in said and "not online" in said


def test_no_housekeeping_cpu_is_an_error_with_the_numbers():
    two = one_npu_host({0: frozenset({0, 1})}, affinity={0: frozenset({0, 1})})
    cfg = Config(small_pool="share", isolation="irqs")
    plan = make_plan(two, worker({0, 1}), [0], cfg)
    iso = plan_isolation(two, [plan], cfg)
    assert iso.error is not None and iso.error.code == NO_HOUSEKEEPING
    assert "0-1 (2 of 2 online CPUs)" in iso.error.reason and "housekeeping_cpus" in iso.error.reason
    assert not iso.moves_irqs
    # nothing bound: no error, whatever the host
    assert plan_isolation(two, [], cfg).error is None


def test_explain_shows_each_cpu_class():
    facts, plans, cfg = fixture_plans("310p-4card", [5], isolation="irqs")
    text = explain_isolation(plan_isolation(facts, plans, cfg))
    assert "isolation irqs: housekeeping CPUs 0-1,8-9" in text
    assert "CPU 42-45  protected     NPU 5 main" in text and "CPU 46     protected     NPU 5 acl" in text
    assert "CPU 40-41  housekeeping  NPU 5 irq" in text and "CPU 50-55  other         NPU 6 pool" in text
    off = explain_isolation(plan_isolation(facts, plans, cfg.replace(isolation="off")))
    assert "isolation off" in off and "IRQ" not in off.split("\n")[1]


# ---------------------------------------------------------------- no level changes a plan


GOLDEN = [(h, c) for h, cases in CASES.items() for c in cases]


@pytest.mark.parametrize("name, case", GOLDEN)
def test_every_golden_plan_is_the_same_at_every_level(name, case):
    with open(golden_path(name, case)) as fh:
        golden = json.load(fh)
    for level in ("off", "irqs", "host"):
        code, plan, _err = run_plan(name, [*CASES[name][case], "--isolation", level])
        assert plan == golden["plan"], f"{name}/{case} at {level}"
        if golden["exit"] != 0 or level == "off":
            assert code == golden["exit"]


def test_plan_explain_shows_the_level_cpu_by_cpu_and_a_refusal_is_exit_3(capsys):
    from ascendbind.cli import main

    code = main(["plan", "--snapshot", os.path.join(HOSTS, "a3-16die"), "--npu", "5", "--explain",
                 "--isolation", "irqs"])
    out = capsys.readouterr().out
    assert code == 0 and f"isolation irqs: housekeeping CPUs {pairs(0, 40, 16)} (auto), protected CPUs 202-239" in out
    assert "CPU 202-237  protected     NPU 5 main" in out and "CPU 200-201  housekeeping  NPU 5 irq" in out
    code = main(["plan", "--snapshot", os.path.join(HOSTS, "a3-16die"), "--npu", "5", "--isolation", "irqs",
                 "--housekeeping-cpus", "202-239"])
    captured = capsys.readouterr()
    assert code == 3 and "no housekeeping CPU is left" in captured.err
    assert "200-239" in captured.out  # the plan is printed all the same: only the bind would be refused


def test_plan_explain_at_host_says_what_the_level_does_to_other_tasks_cpu_by_cpu(capsys):
    from ascendbind.cli import main

    code = main(["plan", "--snapshot", os.path.join(HOSTS, "a2-8x910b3"), "--npu", "3", "--explain",
                 "--isolation", "host"])
    out = capsys.readouterr().out
    assert code == 0 and f"isolation host: housekeeping CPUs {pairs(0, 24, 8)} (auto), protected CPUs 122-143" in out
    assert "no other userspace task" in out and "no unbound workqueue" in out and "pid 1" in out
    assert "no soft-lockup watchdog check" in out
    assert "left to the kernel: unless it isolates CPUs 122-143 from boot (isolcpus=domain,managed_irq,122-143 " \
           "nohz_full=122-143)" in out
    assert "CPU 122-141  protected     NPU 3 main" in out
    facts, plans, cfg = fixture_plans("a2-8x910b3", [3], isolation="host")
    iso = plan_isolation(facts, plans, cfg)
    assert iso.moves_tasks and iso.moves_irqs
    assert not plan_isolation(facts, plans, Config(isolation="irqs")).moves_tasks
    assert not plan_isolation(facts, [], cfg).moves_tasks  # nothing bound: nothing moves


@pytest.mark.parametrize("mask, protected, out", [
    ("0-7", "4-5", "0-3,6-7"),  # every CPU it had but the protected ones
    ("4-6", "4-5", "6"),        # narrowed by its owner: what is left of its own choice, not the housekeeping set
    ("4-5", "4-5", None),       # pinned wholly inside by its owner: left there (reported)
    ("0-1", "4-5", "0-1"),      # already off them: unchanged
])
def test_task_target_keeps_what_the_task_chose_and_never_widens_it(mask, protected, out):
    got = task_target(parse_cpulist(mask), parse_cpulist(protected))
    assert (None if got is None else format_cpulist(got)) == out


# ---------------------------------------------------------------- narrowed and the driver's work

@pytest.mark.parametrize("mask, protected, housekeeping, out", [
    ("0-3", "2-3", "0", "0-1"),       # less the protected CPUs
    ("2-3", "2-3", "0-1", "0-1"),     # nothing left: the housekeeping set
    ("2", "2-3", "", "2"),            # and nowhere to go: unchanged
    ("0-1", "2-3", "0", "0-1"),       # already off them
])
def test_narrowed(mask, protected, housekeeping, out):
    assert narrowed(parse_cpulist(mask), parse_cpulist(protected), parse_cpulist(housekeeping)) == parse_cpulist(out)


@pytest.mark.parametrize("name, device", [
    ("dev0_sq_task", 0), ("dev12_sq_task", 12), ("dev0_sq_taskx", None), ("xdev0_sq_task", None),
    ("kworker/0:1", None), ("dev_sq_task", None),
])
def test_sq_task_names(name, device):
    assert sq_task_device(name) == device


@pytest.mark.parametrize("name, device", [
    ("trs-mbox-3-0", 3), ("trs-mbox-15-1", 15), ("trs-mbox-3", None), ("trs-mbox-a-0", None),
    ("sq_send_trigger_irq", None), ("virtio0-config", None),
])
def test_trs_mbox_names(name, device):
    assert trs_mbox_device(name) == device


def test_sq_send_wq_names():
    assert sq_send_wq_name(2) == "dev2_sq_send_wq" and sq_send_wq_device("dev2_sq_send_wq") == 2
    assert sq_send_wq_device("dev2_sq_send_w") is None  # a 15-character comm is not the workqueue's name


def _two_npus(phy_ids=(None, None)):
    """Two NPUs on one 12-CPU node, NPU 0 near CPUs 0-5 and NPU 1 near 6-11."""
    h = host(12, 1, device_type=DeviceType.A2, chips=[(0, 0, 0), (1, 0, 1)],
             affinity={0: frozenset(range(6)), 1: frozenset(range(6, 12))})
    chips = tuple(dataclasses.replace(c, phy_id=p) for c, p in zip(h.chips, phy_ids))
    return dataclasses.replace(h, chips=chips)


def test_driver_work_goes_to_its_bound_npus_irq_cpus_by_physical_id():
    h = _two_npus(phy_ids=(5, 4))
    assert device_id(h, 0) == 5 and device_id(h, 1) == 4 and device_id(_two_npus(), 1) == 1
    cfg = Config(numa_extension="none", isolation="irqs")
    plan = make_plan(h, worker(range(12)), [1], cfg)
    assert plan.npus[0].irq == (6, 7) and plan.npus[0].release == (11,)
    iso = plan_isolation(h, [plan], cfg)
    assert iso.protected_cpus == frozenset(range(8, 12))
    assert driver_cpus(h, iso) == {4: frozenset({6, 7})}
    # NPU 1 is device 4: its mailbox IRQ goes to its IRQ CPUs; device 5's (NPU 0, unbound) is narrowed
    assert irq_target(frozenset(range(12)), "trs-mbox-4-0", iso, driver_cpus(h, iso)) == {6, 7}
    assert irq_target(frozenset(range(12)), "trs-mbox-5-0", iso, driver_cpus(h, iso)) == frozenset(range(8))


def test_driver_work_of_an_npu_whose_irq_cpu_is_protected_follows_the_ordinary_rule():
    h = _two_npus()
    cfg = Config(numa_extension="none", small_pool="share", isolation="irqs")
    tiny = dataclasses.replace(h, topo_affinity=frozen_map({0: frozenset({0}), 1: frozenset({1})}))
    plan = make_plan(tiny, worker(range(12)), [1], cfg)
    assert plan.npus[0].irq == (1,) and plan.npus[0].main == (1,)  # one CPU: every role
    iso = plan_isolation(tiny, [plan], cfg)
    assert driver_cpus(tiny, iso) == {}
    assert irq_target(frozenset({1}), "trs-mbox-1-0", iso, {}) == iso.housekeeping


# ---------------------------------------------------------------- one mask

def H(text: str | None) -> frozenset[int] | None:
    return None if text is None else parse_cpulist(text)


@pytest.mark.parametrize("saved, current, wanted, act", [
    (None, "0-3", None, Act.NOTHING),                      # not ours, nothing wanted
    (None, "0-1", "0-1", Act.NOTHING),                     # already off the protected CPUs
    (None, None, "0-1", Act.NOTHING),                      # gone before we looked
    (None, "0-3", "0-1", Act.WRITE),                       # narrow it
    (("0-3", ["0-1"]), "0-1", "0-1", Act.KEEP),            # ours, as wanted
    (("0-3", ["0-1"]), "0-1", "0", Act.WRITE),             # ours, another worker bound
    (("0-3", ["0-1"]), "0-1", None, Act.RESTORE),          # no longer wanted
    (("0-3", ["0-1"]), "0-1", "0-3", Act.RESTORE),         # wanted as it was
    (("0-3", ["0-1", "0"]), "0-1", None, Act.RESTORE),     # a crash before the second write landed
    (("0-3", ["0-1"]), "0-3", None, Act.SETTLED),          # a crash before the first write landed
    (("0-3", ["0-1"]), "0-3", "0-1", Act.WRITE),           # ... and still wanted
    (("0-3", ["0-1"]), "2", None, Act.OWNER),              # changed by its owner: left
    (("0-3", ["0-1"]), "2", "0-1", Act.OWNER),
    (("0-3", ["0-1"]), None, None, Act.GONE),              # the IRQ was freed
])
def test_mask_act(saved, current, wanted, act):
    s = None if saved is None else TaskSaved(saved[0], tuple(saved[1]))
    assert mask_act(s, H(current), H(wanted)) is act


# ---------------------------------------------------------------- the record and the state file

RECORD = IsolationRecord(frozen_map({MaskKey.of("irq", 24): IrqSaved("3", ("1",)), "default": DefaultSaved("3", ("1",)),
                                     MaskKey.of("workqueue", "dev0_sq_send_wq"): WorkqueueSaved("ff", ("3",)),
                                     MaskKey.of("task", 812, 4711): TaskSaved("0-7", ("0-1",))}),
                         SavedBan(77, 1234, "00000000", ("1",)))


def test_the_record_round_trips_and_refuses_what_is_not_one():
    assert IsolationRecord.from_json(json.loads(json.dumps(RECORD.to_json()))) == RECORD
    assert IsolationRecord().to_json() == {} and IsolationRecord.from_json({}).empty
    for bad in ({"masks": {"irq:x": {"original": "3", "ours": []}}}, {"masks": {"irq:1": {"original": "3; rm",
                                                                                             "ours": []}}},
                {"masks": {}, "other": 1}, {"irqbalance": {"pid": -1, "original": "0", "ours": []}},
                {"masks": {"task:1": {"original": "0", "ours": []}}}):
        with pytest.raises(ValueError):
            IsolationRecord.from_json(bad)
    with pytest.raises(ValueError):
        MaskKey.of("irq", "../x")


def test_the_state_file_keeps_the_record_beside_the_workers_and_still_reads_older_files(tmp_path):
    sf = StateFile(str(tmp_path / "st"))
    sf.prepare()
    sf.save([], isolation=RECORD.to_json())
    assert IsolationRecord.from_json(sf.load().isolation) == RECORD
    doc = json.loads((tmp_path / "st" / "state.json").read_text())
    assert doc["version"] == 2 and doc["isolation_checksum"]
    # a file written before the record existed (no isolation key) loads, with no record
    sf.save([])
    raw = json.loads((tmp_path / "st" / "state.json").read_text())
    assert "isolation" not in raw and sf.load().isolation is None
    # a changed record fails its checksum: the file is moved aside like any corrupt one
    sf.save([], isolation=RECORD.to_json())
    doc = json.loads((tmp_path / "st" / "state.json").read_text())
    doc["isolation"]["masks"]["irq:24"]["original"] = "2"
    (tmp_path / "st" / "state.json").write_text(json.dumps(doc))
    out = sf.load()
    assert out.isolation is None and out.moved_aside and "isolation checksum" in out.problem
    assert not Path(tmp_path / "st" / "state.json").exists()


# ---------------------------------------------------------------- irqbalance's words

def test_the_banned_cpu_command_and_what_reset_gives_back():
    assert cpus_command({0, 1, 2, 8}) == "settings cpus 0-2,8"
    with pytest.raises(ValueError):
        cpus_command(set())  # irqbalance 1.9 crashes on an empty list: never sent
    assert auto_banned_cpus({}, frozenset({3})) == {3}
    assert auto_banned_cpus({"IRQBALANCE_BANNED_CPULIST": "0-1"}, frozenset({3})) == {0, 1}
    assert auto_banned_cpus({"IRQBALANCE_BANNED_CPUS": "00000005"}, frozenset()) == {0, 2}
    assert auto_banned_cpus({"IRQBALANCE_BANNED_CPULIST": "zero"}, frozenset()) is None


# ---------------------------------------------------------------- the config keys

def test_isolation_keys_from_file_environment_and_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('isolation = "irqs"\nhousekeeping_cpus = "0-1"\nisolation_exempt = ["/system.slice/a.service", '
                    '"agent*"]\n')
    cfg = load_config(str(path), env={})
    assert (cfg.isolation, cfg.housekeeping_cpus) == ("irqs", "0-1")
    assert exempt_entries(cfg.isolation_exempt) == (("/system.slice/a.service",), ("agent*",))
    cfg = load_config(str(path), env={"ASCENDBIND_ISOLATION_EXEMPT": "tool*, /k.slice/"},
                      overrides={"housekeeping_cpus": "auto"})
    assert cfg.isolation_exempt == ("tool*", "/k.slice/") and cfg.housekeeping_cpus == "auto"
    assert load_config(None, env={"ASCENDBIND_ISOLATION_EXEMPT": ""}).isolation_exempt == ()


@pytest.mark.parametrize("env, says", [
    ({"ASCENDBIND_ISOLATION": "full"}, "must be one of off, irqs, host"),
    ({"ASCENDBIND_HOUSEKEEPING_CPUS": "0-x"}, "'auto' or a cpu list"),
    ({"ASCENDBIND_HOUSEKEEPING_CPUS": " "}, "an empty list"),
    ({"ASCENDBIND_ISOLATION_EXEMPT": "/"}, "root cgroup"),
    ({"ASCENDBIND_ISOLATION_EXEMPT": "a/b"}, "does not start with it"),
    ({"ASCENDBIND_ISOLATION_EXEMPT": "/a/../b"}, "not a plain cgroup path"),
    ({"ASCENDBIND_ISOLATION_EXEMPT": "a,,b"}, "empty entry"),
    ({"ASCENDBIND_ISOLATION_EXEMPT": "x" * 70}, "longer than 64"),
])
def test_bad_isolation_values_are_named(env, says):
    with pytest.raises(ConfigError, match=next(iter(env))) as exc:
        load_config(None, env=env)
    assert says in str(exc.value)


def test_the_driver_id_is_the_logic_id_without_a_phy_id_column():
    h = one_npu_host({0: frozenset({0, 1})})
    assert h.chips == (NpuChip(card=0, chip=0, logic_id=0, name="Ascend 910B3"),) and device_id(h, 0) == 0
