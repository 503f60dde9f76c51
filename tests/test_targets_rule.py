"""The target rule (planner/npus/targets.py) as tables: evidence and request in, NPUs and rule out.

Each precedence step has its rows; each row is a worker as a deployment leaves it (device
nodes, devices cgroup, driver map, process table, environment) and what the rule must
answer: the NPUs and the rule, or the refusal's code. The hosts: an A2 of 8 x 910B3
whose npu-smi prints no Chip Phy-ID (physical = logical), and an Ascend 950 whose
logical ids differ from the physical ones (NPU k is physical (k + 4) % 8), as the device
nodes' names differ from their minors there.
"""

from __future__ import annotations

import dataclasses

import pytest

from ascendbind.errors import Conflict, PlanImpossible, UsageError
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import NpuChip, NpuProcess
from ascendbind.planner import resolve_targets
from ascendbind.values.targeting import RULES, CgroupDevices, DeviceNode, NpuEvidence, TargetRequest
from tests.planner_hosts import a2_host, a950_host, worker

MAJOR = 236
PHY_950 = {k: (k + 4) % 8 for k in range(8)}  # logical -> physical on the 950 host


def h950(**kw):
    h = a950_host(**kw)
    chips = tuple(NpuChip(card=k, chip=0, logic_id=k, name="Ascend950PR", phy_id=PHY_950[k]) for k in range(8))
    return dataclasses.replace(h, chips=chips, chip_name="Ascend950PR")


def nodes(*pairs):
    """DeviceNode per (name, minor)."""
    return tuple(DeviceNode(name, MAJOR, minor) for name, minor in pairs)


def ev(*, host_ns=False, dev=None, cgroup="absent", driver=None, unavailable=None):
    """Evidence of a worker: ``dev`` its device nodes (None: unreadable), ``cgroup`` the minors
    its devices.list allows ("absent": no v1 devices cgroup, None: every minor)."""
    cg = None if cgroup == "absent" else CgroupDevices(None if cgroup is None else frozenset(cgroup), "devices.list")
    return NpuEvidence(major=MAJOR, host_namespace=host_ns, device_nodes=dev, cgroup_devices=cg,
                       driver_udevids=driver, unavailable=frozen_map(unavailable or {}))


def w(evidence=None, *, pid=4242, env=None):
    return dataclasses.replace(worker(range(192), pid=pid, env=env), npu_evidence=evidence)


def table(*rows):
    return tuple(NpuProcess(npu=n, pid=p, name="VLLMWorker") for p, n in rows)


def decide(host, wk, **req):
    if "npus" in req:
        req["npus"] = tuple(req["npus"])
    return resolve_targets(host, wk, TargetRequest(**req))


def refused(host, wk, code, **req):
    kind = Conflict if code == "npu_mismatch" else PlanImpossible
    with pytest.raises(kind) as exc:
        decide(host, wk, **req)
    assert exc.value.code == code
    return str(exc.value)


BARE = ev(host_ns=True)
POD5 = ev(dev=nodes(("davinci5", 5)), cgroup={5})  # the device plugin gave physical NPU 5
PLUGIN_ENV = {"ASCEND_VISIBLE_DEVICES": "5", "ASCEND_RUNTIME_OPTIONS": ""}


# ------------------------------------------------------------ a. the request's NPUs

@pytest.mark.parametrize("name, host, wk, req, npus", [
    ("bare host, nothing else known", a2_host(), w(BARE), {"npus": [3, 1]}, (1, 3)),
    ("bare host, the table agrees", a2_host(processes=table((4242, 3))), w(BARE), {"npus": [3]}, (3,)),
    ("pod, the request names its device", a2_host(), w(POD5, env=PLUGIN_ENV), {"npus": [5]}, (5,)),
    ("the driver lists two, the request one of them", a2_host(), w(ev(host_ns=True, driver=(2, 6))),
     {"npus": [6]}, (6,)),
])
def test_a_request_naming_npus_the_evidence_allows_is_kept(name, host, wk, req, npus):
    d = decide(host, wk, **req)
    assert (d.npus, d.rule) == (npus, "request"), name


@pytest.mark.parametrize("name, host, wk, req, says", [
    ("a pod's local index sent as an NPU", a2_host(), w(POD5, env=PLUGIN_ENV), {"npus": [0]},
     "names NPU 0, but pid 4242 can reach only NPU 5"),
    ("the table puts it elsewhere", a2_host(processes=table((4242, 2))), w(BARE), {"npus": [3]},
     "process table puts pid 4242 on NPU 2"),
    ("the driver puts it elsewhere", a2_host(), w(ev(host_ns=True, driver=(4,))), {"npus": [3]},
     "driver puts pid 4242 on NPU 4"),
    ("a container without NPU devices", a2_host(), w(ev(dev=())), {"npus": [1]}, "can reach only NPU none"),
    ("ASCEND_VISIBLE_DEVICES when /dev is unreadable", a2_host(), w(ev(dev=None), env=PLUGIN_ENV),
     {"npus": [0]}, "ASCEND_VISIBLE_DEVICES: NPU 5"),
])
def test_a_request_the_evidence_contradicts_is_npu_mismatch_naming_both(name, host, wk, req, says):
    text = refused(host, wk, "npu_mismatch", **req)
    assert says in text, name


def test_a_mismatch_carries_the_evidence_lines():
    with pytest.raises(Conflict) as exc:
        decide(a2_host(), w(POD5, env=PLUGIN_ENV), npus=[0])
    lines = {e.source: e for e in exc.value.evidence}
    assert lines["device_nodes"].npus == (5,) and "/dev/davinci5 (236:5)" in lines["device_nodes"].detail
    assert lines["request"].npus == (0,)


def test_an_npu_the_host_lacks_is_unknown_npu_and_an_unlisted_host_checks_nothing():
    assert "npu-smi info -m lists 0-7" in refused(a2_host(), w(BARE), "unknown_npu", npus=[9])
    bare_host = dataclasses.replace(a2_host(), chips=())
    assert decide(bare_host, w(None), npus=[12]).npus == (12,)
    refused(bare_host, w(None), "unknown_npu", npus=[-1])


def test_npus_and_a_device_index_together_are_a_usage_error():
    with pytest.raises(UsageError):
        decide(a2_host(), w(BARE), npus=[1], device_index=0)


# ------------------------------------------------------------ b. the request's device index

@pytest.mark.parametrize("name, host, wk, index, npu", [
    ("bare host: index i is NPU i", a2_host(), w(BARE), 2, 2),
    ("bare host, ASCEND_RT_VISIBLE_DEVICES re-indexes", a2_host(), w(BARE, env={"ASCEND_RT_VISIBLE_DEVICES": "6,1"}),
     0, 6),
    ("device plugin pod: device 0 is physical 5", a2_host(), w(POD5, env=PLUGIN_ENV), 0, 5),
    ("pod of two: devices in udevid order", a2_host(), w(ev(dev=nodes(("davinci7", 7), ("davinci2", 2)))), 1, 7),
    ("pod of two, re-indexed", a2_host(), w(ev(dev=nodes(("davinci7", 7), ("davinci2", 2))),
                                            env={"ASCEND_RT_VISIBLE_DEVICES": "1,0"}), 0, 7),
    ("HAMi vNPU of physical 4", a2_host(), w(ev(dev=nodes(("vdavinci165", 165))),
                                             env={"ASCEND_VISIBLE_DEVICES": "4", "ASCEND_VNPU_SPECS": "vir05"}), 0, 4),
    ("a vNPU the runtime renamed davinci<udevid>", a2_host(), w(ev(dev=nodes(("davinci181", 181)))), 0, 5),
    ("950 pod: named by logic id, minor physical", h950(), w(ev(dev=nodes(("davinci2", PHY_950[2]))),
                                                              env={"ASCEND_VISIBLE_DEVICES": "2"}), 0, 2),
    ("950 pod of two: udevid order, not name order", h950(),
     w(ev(dev=nodes(("davinci1", PHY_950[1]), ("davinci6", PHY_950[6])))), 0, 6),
    ("950 bare host: index is the logic id", h950(), w(BARE), 5, 5),
    ("the table agrees", a2_host(processes=table((4242, 2))), w(BARE), 2, 2),
])
def test_a_device_index_resolves_through_the_runtimes_devices(name, host, wk, index, npu):
    d = decide(host, wk, device_index=index)
    assert (d.npus, d.rule) == ((npu,), "device_index"), name


@pytest.mark.parametrize("name, host, wk, index, says", [
    ("past the pod's devices", a2_host(), w(POD5), 1, "runtime sees 1 device(s): NPU 5"),
    ("the table puts it on another", a2_host(processes=table((4242, 3))), w(BARE), 2,
     "device index 2 is NPU 2, but the process table puts pid 4242 on NPU 3"),
    ("ASCEND_RT_VISIBLE_DEVICES past the devices", a2_host(), w(POD5, env={"ASCEND_RT_VISIBLE_DEVICES": "3"}), 0,
     "names index 3, but pid 4242 sees 1 device(s)"),
    ("malformed ASCEND_RT_VISIBLE_DEVICES", a2_host(), w(BARE, env={"ASCEND_RT_VISIBLE_DEVICES": "0,x"}), 0,
     "'0,x'"),
])
def test_a_device_index_the_evidence_cannot_hold_is_npu_mismatch(name, host, wk, index, says):
    assert says in refused(host, wk, "npu_mismatch", device_index=index), name


# ------------------------------------------------------------ c. the use: driver, then process table

@pytest.mark.parametrize("name, host, wk, npus, rule", [
    ("the process table", a2_host(processes=table((4242, 5), (4242, 4), (77, 2))), w(BARE), (4, 5),
     "process_table"),
    ("the driver map wins over the table", a2_host(processes=table((4242, 3))), w(ev(host_ns=True, driver=(6,))),
     (6,), "driver"),
    ("an empty driver map leaves it to the table", a2_host(processes=table((4242, 3))),
     w(ev(host_ns=True, driver=())), (3,), "process_table"),
    ("a driver context on a vNPU", a2_host(), w(ev(dev=nodes(("vdavinci116", 116)), driver=(116,))), (1,),
     "driver"),
    ("950: the driver's udevid is physical", h950(), w(ev(host_ns=True, driver=(PHY_950[7],))), (7,), "driver"),
    ("the table inside the pod's reach", a2_host(processes=table((4242, 5))), w(POD5), (5,), "process_table"),
])
def test_the_use_decides_without_a_request(name, host, wk, npus, rule):
    d = decide(host, wk)
    assert (d.npus, d.rule) == (npus, rule), name


def test_a_table_row_outside_the_reach_is_dropped_with_a_warning():
    # a pid of another namespace, or a stale table: the kernel's device set wins
    d = decide(a2_host(processes=table((4242, 2))), w(POD5, env=PLUGIN_ENV))
    assert (d.npus, d.rule) == ((5,), "container_devices")
    assert any("process table puts pid 4242 on NPU 2" in x and "ignored" in x for x in d.warnings)


def test_a_table_not_read_says_so_and_decides_nothing():
    wk = w(ev(host_ns=True, unavailable={"process_table": "not read: the request names its NPU"}))
    d = decide(a2_host(processes=table((4242, 2))), wk, npus=[3])
    assert d.npus == (3,)
    line = next(e for e in d.evidence if e.source == "process_table")
    assert line.npus is None and "not read" in line.detail


# ------------------------------------------------------------ d. the reach, when it narrows

@pytest.mark.parametrize("name, host, wk, npus, rule", [
    ("device plugin pod", a2_host(), w(POD5, env=PLUGIN_ENV), (5,), "container_devices"),
    ("bare docker --device, no variables", a2_host(), w(ev(dev=nodes(("davinci6", 6))), env={}), (6,),
     "container_devices"),
    ("950 pod: the minor, not the name", h950(), w(ev(dev=nodes(("davinci2", PHY_950[2]))),
                                                   env={"ASCEND_VISIBLE_DEVICES": "2"}), (2,), "container_devices"),
    ("a forged node the devices cgroup does not allow", a2_host(), w(ev(dev=nodes(("davinci5", 5), ("davinci0", 0)),
                                                                     cgroup={5})), (5,), "container_devices"),
    ("the devices cgroup alone (a host-namespace worker in one)", a2_host(), w(ev(host_ns=True, cgroup={3})), (3,),
     "container_devices"),
    ("/dev unreadable: ASCEND_VISIBLE_DEVICES", a2_host(), w(ev(dev=None), env=PLUGIN_ENV), (5,),
     "visible_devices"),
    ("950, /dev unreadable: ASCEND_VISIBLE_DEVICES holds logic ids", h950(),
     w(ev(dev=None), env={"ASCEND_VISIBLE_DEVICES": "3"}), (3,), "visible_devices"),
    ("static vNPU by udevid", a2_host(), w(ev(dev=None), env={"ASCEND_VISIBLE_DEVICES": "148",
                                                              "ASCEND_RUNTIME_OPTIONS": "VIRTUAL"}), (3,),
     "visible_devices"),
    ("chip names and ranges", a2_host(), w(ev(dev=None), env={"ASCEND_VISIBLE_DEVICES": "Ascend910-6"}), (6,),
     "visible_devices"),
    ("bare host, ASCEND_RT_VISIBLE_DEVICES of one", a2_host(), w(BARE, env={"ASCEND_RT_VISIBLE_DEVICES": "4"}),
     (4,), "rt_visible_devices"),
    ("several reachable: the busy ones", a2_host(processes=table((77, 2))),
     w(BARE, env={"ASCEND_RT_VISIBLE_DEVICES": "2, 3"}), (2,), "rt_visible_devices"),
    ("several reachable, none busy: all", a2_host(), w(ev(dev=nodes(("davinci1", 1), ("davinci3", 3)))), (1, 3),
     "container_devices"),
])
def test_a_narrowed_reach_decides_when_nothing_else_does(name, host, wk, npus, rule):
    d = decide(host, wk)
    assert (d.npus, d.rule) == (npus, rule), name


@pytest.mark.parametrize("req", [{}, {"device_index": 0}, {"npus": [5]}])
def test_ascend_visible_devices_naming_a_device_the_worker_cannot_open_is_refused(req):
    # the runtime would see no such device: which one the worker drives is not known, so nothing is guessed
    text = refused(a2_host(), w(POD5, env={"ASCEND_VISIBLE_DEVICES": "2"}), "npu_mismatch", **req)
    assert "ASCEND_VISIBLE_DEVICES=2" in text and "names NPU 2" in text and "NPU 5" in text


def test_a_worker_in_the_host_namespace_reaches_every_npu():
    d = decide(a2_host(), w(ev(host_ns=True, dev=nodes(("davinci1", 1)))), device_index=6)
    assert d.npus == (6,)
    assert "host's mount namespace" in next(e.detail for e in d.evidence if e.source == "device_nodes")


def test_the_environment_sent_with_the_request_wins_over_the_start_up_one():
    wk = w(BARE, env={"ASCEND_RT_VISIBLE_DEVICES": "0,1"})
    d = resolve_targets(a2_host(), wk, TargetRequest(device_index=0, env={"ASCEND_RT_VISIBLE_DEVICES": "7"}))
    assert d.npus == (7,)
    assert "sent with the request" in next(e.detail for e in d.evidence if e.source == "rt_visible_devices")


def test_without_a_phy_id_column_physical_ids_are_assumed_logical_and_it_says_so():
    d = decide(a2_host(), w(POD5))
    assert any("no Chip Phy-ID" in x for x in d.warnings)
    assert not any("Chip Phy-ID" in x for x in decide(h950(), w(BARE), device_index=0).warnings)


# ------------------------------------------------------------ e. nothing

def test_no_evidence_and_no_request_is_no_target_npu_saying_what_was_tried():
    text = refused(a2_host(processes=table((77, 5))), w(BARE, pid=1000), "no_target_npu")
    for said in ("npu-smi info lists no process 1000", "host's mount namespace", "ASCEND_RT_VISIBLE_DEVICES unset"):
        assert said in text


def test_a_container_without_npu_devices_is_no_target_npu():
    assert "can reach no NPU" in refused(a2_host(), w(ev(dev=())), "no_target_npu")


def test_a_malformed_visible_devices_is_a_warning_not_a_guess():
    d = decide(a2_host(), w(POD5, env={"ASCEND_VISIBLE_DEVICES": "5;6"}))
    assert d.npus == (5,) and any("'5;6'" in x for x in d.warnings)


# ------------------------------------------------------------ the decision as a value

def test_every_rule_is_reached_by_some_row_and_the_decision_round_trips_json():
    from ascendbind.values.targeting import TargetDecision

    seen = {decide(a2_host(), w(BARE), npus=[1]).rule, decide(a2_host(), w(BARE), device_index=0).rule,
            decide(a2_host(), w(ev(host_ns=True, driver=(1,)))).rule,
            decide(a2_host(processes=table((4242, 1))), w(BARE)).rule, decide(a2_host(), w(POD5)).rule,
            decide(a2_host(), w(ev(dev=None), env=PLUGIN_ENV)).rule,
            decide(a2_host(), w(BARE, env={"ASCEND_RT_VISIBLE_DEVICES": "1"})).rule}
    assert seen == set(RULES)
    d = decide(a2_host(processes=table((4242, 2))), w(POD5, env=PLUGIN_ENV), device_index=0)
    assert TargetDecision.from_json(d.to_json()) == d
    assert d.lines()[0].startswith("targets: NPU 5 by rule device_index")


# ------------------------------------------------------------ one rule for the runtime's devices

def a2_phy(**kw):
    """An A2 whose npu-smi prints Chip Phy-ID: logical NPU k is physical (k + 4) % 8."""
    h = a2_host(**kw)
    chips = tuple(NpuChip(card=k, chip=0, logic_id=k, name="Ascend910B3", phy_id=(k + 4) % 8) for k in range(8))
    return dataclasses.replace(h, chips=chips)


RENAMED = ev(dev=nodes(*((f"davinci{i}", 3 + i) for i in range(5))), cgroup={3, 4, 5, 6, 7})  # host NPUs 3..7
HOST_3_TO_7 = ev(dev=nodes(*((f"davinci{n}", n) for n in range(3, 8))), cgroup={3, 4, 5, 6, 7})
ALL_8 = ev(dev=nodes(*((f"davinci{n}", n) for n in range(8))), cgroup=None)
MOTOR = {"ASCEND_VISIBLE_DEVICES": "4,5,6,7", "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}


@pytest.mark.parametrize("name, host, evidence, env, index, npu", [
    # the node's name says nothing: /dev/davinci0..4 are the host's NPUs 3..7 by minor
    ("renamed nodes, RT=2, device 0", a2_host(), RENAMED, {"ASCEND_RT_VISIBLE_DEVICES": "2"}, 0, 5),
    ("renamed nodes, device 0", a2_host(), RENAMED, {}, 0, 3),
    ("renamed nodes, device 4", a2_host(), RENAMED, {}, 4, 7),
    ("host NPUs 3..7 named as on the host, RT=2", a2_host(), HOST_3_TO_7, {"ASCEND_RT_VISIBLE_DEVICES": "2"}, 0, 5),
    ("renamed nodes in reverse, RT=1,0", a2_host(), ev(dev=nodes(("davinci0", 6), ("davinci1", 2)), cgroup={2, 6}),
     {"ASCEND_RT_VISIBLE_DEVICES": "1,0"}, 0, 6),
    # partly mounted: the cgroup allows 3..5, only 3 and 5 have a node
    ("partly mounted", a2_host(), ev(dev=nodes(("davinci3", 3), ("davinci5", 5)), cgroup={3, 4, 5}), {}, 1, 5),
    ("the cgroup narrower than the nodes", a2_host(), ev(dev=HOST_3_TO_7.device_nodes, cgroup={4, 6}), {}, 1, 6),
    # MindIE Motor: physical ASCEND_VISIBLE_DEVICES, positions in ASCEND_RT_VISIBLE_DEVICES
    ("Motor, bare host", a2_host(), BARE, MOTOR, 2, 6),
    ("Motor, a container of every NPU", a2_host(), ALL_8, MOTOR, 2, 6),
    ("Motor, a container of 4..7", a2_host(), ev(dev=nodes(*((f"davinci{n}", n) for n in range(4, 8))),
                                                 cgroup={4, 5, 6, 7}), MOTOR, 3, 7),
    ("Motor, /dev unreadable", a2_host(), ev(), MOTOR, 1, 5),
    # vllm-ascend: the device index is a position among the runtime's devices, not a table row
    ("bare host, RT=4,5,6,7", a2_host(processes=table((4242, 5))), BARE, {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"},
     1, 5),
    ("bare host, device 3", a2_host(), BARE, {}, 3, 3),
    # HAMi: a vNPU node's minor is 100 + 16 x physical + sub-device
    ("HAMi vNPU of NPU 5", a2_host(), ev(dev=nodes(("vdavinci180", 180)), cgroup={180}),
     {"ASCEND_VISIBLE_DEVICES": "5"}, 0, 5),
    ("HAMi vNPU renamed davinci0", a2_host(), ev(dev=nodes(("davinci0", 181)), cgroup={181}), {}, 0, 5),
    # physical -> logical through npu-smi's Chip Phy-ID: physical 5 is logical 1
    ("renamed nodes, physical ids", a2_phy(), RENAMED, {"ASCEND_RT_VISIBLE_DEVICES": "2"}, 0, 1),
    ("Motor on physical ids", a2_phy(), BARE, MOTOR, 0, 0),
])
def test_the_runtimes_devices_then_the_variables_then_the_index(name, host, evidence, env, index, npu):
    d = decide(host, w(evidence, env=env), device_index=index)
    assert (d.npus, d.rule) == ((npu,), "device_index"), name
    assert d.steps[-1].startswith(f"device index {index} -> NPU {npu}"), d.steps


@pytest.mark.parametrize("name, host, evidence, env, req, says", [
    ("the index past the devices", a2_host(), RENAMED, {}, {"device_index": 5}, "sees 5 device(s)"),
    ("RT past the devices", a2_host(), RENAMED, {"ASCEND_RT_VISIBLE_DEVICES": "5"}, {"device_index": 0},
     "names index 5"),
    ("the variable names an NPU the nodes lack", a2_host(), RENAMED, {"ASCEND_VISIBLE_DEVICES": "1"},
     {"device_index": 0}, "names NPU 1, which pid 4242 cannot open"),
    ("Motor's variables in a container of 0..3", a2_host(), ev(dev=nodes(*((f"d{n}", n) for n in range(4))),
                                                            cgroup={0, 1, 2, 3}), MOTOR, {}, "names NPU 4,5,6,7"),
    ("a container whose devices cannot be read, RT=2", a2_host(), ev(),
     {"ASCEND_RT_VISIBLE_DEVICES": "2"}, {"device_index": 0}, "could not be read"),
    ("a container whose devices cannot be read", a2_host(), ev(), {}, {"device_index": 0}, "could not be read"),
    ("the table disagrees with the index", a2_host(processes=table((4242, 3))), RENAMED,
     {"ASCEND_RT_VISIBLE_DEVICES": "2"}, {"device_index": 0}, "device index 0 is NPU 5"),
    ("a request NPU the rule does not give", a2_host(), RENAMED, {}, {"npus": [2]}, "names NPU 2"),
])
def test_a_contradiction_is_refused_naming_the_steps(name, host, evidence, env, req, says):
    text = refused(host, w(evidence, env=env), "npu_mismatch", **req)
    assert says in text, (name, text)


def test_the_steps_show_each_variable():
    d = decide(a2_host(), w(ALL_8, env=MOTOR), device_index=2)
    assert d.steps == ("found NPU 0,1,2,3,4,5,6,7; ASCEND_VISIBLE_DEVICES keeps NPU 4,5,6,7",
                       "it can open NPU 4,5,6,7: its container's device nodes: NPU 0,1,2,3,4,5,6,7, of which "
                       "ASCEND_VISIBLE_DEVICES names NPU 4,5,6,7",
                       "after ASCEND_RT_VISIBLE_DEVICES=0,1,2,3: device 0 = NPU 4, device 1 = NPU 5, device 2 = NPU 6, "
                       "device 3 = NPU 7",
                       "device index 2 -> NPU 6")
    assert any(line.startswith("  runtime: device index 2 -> NPU 6") for line in d.lines())
    phy = decide(a2_phy(), w(RENAMED, env={"ASCEND_RT_VISIBLE_DEVICES": "2"}), device_index=0)
    assert phy.steps[-1] == "device index 0 -> NPU 1 (physical 5)"


# ------------------------------------------------------------ stray contexts: listed on NPU 0 and on its own

STRAY = table((4242, 3), (4242, 0))


@pytest.mark.parametrize("name, evidence, env, req, npus, rule", [
    ("ASCEND_VISIBLE_DEVICES=3 on the host", BARE, {"ASCEND_VISIBLE_DEVICES": "3"}, {}, (3,), "process_table"),
    ("ASCEND_RT_VISIBLE_DEVICES=3 on the host", BARE, {"ASCEND_RT_VISIBLE_DEVICES": "3"}, {}, (3,), "process_table"),
    ("a container of NPU 3", ev(dev=nodes(("davinci3", 3)), cgroup={3}), {}, {}, (3,), "process_table"),
    ("a device index", BARE, {"ASCEND_RT_VISIBLE_DEVICES": "3"}, {"device_index": 0}, (3,), "device_index"),
    ("a request", BARE, {}, {"npus": [3]}, (3,), "request"),
])
def test_a_stray_context_on_npu_0_is_left_out_with_a_warning(name, evidence, env, req, npus, rule):
    d = decide(a2_host(processes=STRAY), w(evidence, env=env), **req)
    assert (d.npus, d.rule) == (npus, rule), name
    assert any("NPU 0" in x for x in d.warnings), d.warnings


@pytest.mark.parametrize("evidence, env", [(BARE, {}), (ALL_8, {}), (BARE, {"ASCEND_RT_VISIBLE_DEVICES": "0,3"})])
def test_a_stray_context_without_evidence_is_refused_naming_both(evidence, env):
    text = refused(a2_host(processes=STRAY), w(evidence, env=env), "stray_context")
    assert "NPU 0 and NPU 3" in text and "pid 4242" in text


def test_a_worker_listed_on_two_npus_other_than_0_keeps_both():
    d = decide(a2_host(processes=table((4242, 3), (4242, 5))), w(BARE))
    assert (d.npus, d.rule, d.warnings) == ((3, 5), "process_table", ())
