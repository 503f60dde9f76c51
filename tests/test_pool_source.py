"""pool_source: the worker's own cpuset as its pool, and kubelet's checkpoint as the proof.

The figures come from snapshot hosts of Kubernetes nodes (fixtures/hosts/a3-k8s,
a2-k8s: kubelet's checkpoint in its own format, each worker's cgroup files), planned
through the CLI as an operator would; the parser and the matching rule are driven
with plain text, hostile text included.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from ascendbind.values.config import Config
from ascendbind.discovery import SnapshotHost
from ascendbind.discovery.parse.kubelet import (CHECKPOINT_LIMIT, judge_own_cpus, parse_cpu_manager_state, kubelet_place)
from ascendbind.discovery.gather.worker import discover_worker
from ascendbind.errors import ConfigError, ParseError
from ascendbind.values.model import PoolEvidence
from ascendbind.planner import make_plan
from ascendbind.planner.explain import explain_plan
from ascendbind.settings import load_config
from tests.golden import HOSTS, run_plan
from tests.planner_hosts import a2_host, a3_host, worker

UID = "2f0c9a6e-7b1d-4c3e-9a51-5d1e3b7c8a20"
CID = "a3" * 32
SYSTEMD = f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope"


def checkpoint(entries, default="0-199,280-639", policy="static"):
    return json.dumps({"policyName": policy, "defaultCpuSet": default, "entries": entries, "checksum": 1})


def r(lo, hi):
    return frozenset(range(lo, hi + 1))


# ---------------------------------------------------------------- the figures


def test_a3_pod_with_its_own_40_cpus_is_planned_with_them_under_auto():
    code, plan, err = run_plan("a3-k8s", ["--pid", "2105", "--npu", "5"])
    assert code == 0, err
    p = plan["npus"]["5"]
    assert p["pool"] == list(range(200, 240))
    assert (p["irq"], p["main"], p["acl"], p["release"]) == ([200, 201], list(range(202, 238)), [238], [239])
    assert plan["pool_source"]["source"] == "cpuset" and plan["pool_source"]["requested"] == "auto"
    assert f"pod {UID}" in plan["pool_source"]["evidence"] and "'vllm'" in plan["pool_source"]["evidence"]
    assert plan["alignment"]["aligned"] is True and p["numa_nodes"] == [2]


def test_a3_pod_is_refused_as_before_under_slice():
    code, plan, err = run_plan("a3-k8s", ["--pid", "2105", "--npu", "5", "--pool-source", "slice"])
    assert code == 3 and plan["npus"] == {} and "pool_source" not in plan
    assert plan["errors"][0]["code"] == "slice_too_small"
    assert "need 80 CPUs for 16 NPUs, cpuset has 40" in plan["errors"][0]["reason"]


def test_a2_pod_keeps_all_12_of_its_cpus():
    code, plan, _ = run_plan("a2-k8s", ["--pid", "3101"])
    assert code == 0 and plan["npus"]["0"]["pool"] == list(range(150, 162))
    assert plan["npus"]["0"]["irq"] == [150, 151] and plan["npus"]["0"]["release"] == [161]
    # the placement rules share NPU 0's affinity group with hidden NPU 2: half of the pod's CPUs
    code, sliced, _ = run_plan("a2-k8s", ["--pid", "3101", "--pool-source", "slice"])
    assert code == 0 and sliced["npus"]["0"]["pool"] == list(range(150, 156))


@pytest.mark.parametrize(("pid", "npu", "why"), [
    ("2106", "6", "no entry of pod 7c41d2b0-93e5-4f6a-b8c2-1e0d9f4a6b37"),
    ("2107", "7", "holds no exclusive CPUs for pod 0a9e8d7c"),
    ("2108", "10", "is not a Kubernetes pod's; a cpuset narrower than the host (400-439) is not proof by itself"),
])
def test_auto_without_proof_keeps_the_placement_rules_and_says_why(pid, npu, why):
    code, plan, _ = run_plan("a3-k8s", ["--pid", pid, "--npu", npu])
    assert "pool_source" not in plan
    host = SnapshotHost(f"{HOSTS}/a3-k8s")
    w = discover_worker(host, int(pid), Config())
    assert w.pool_evidence is not None and not w.pool_evidence.own and why in w.pool_evidence.detail


def test_cpuset_takes_a_docker_cpuset_without_proof():
    code, plan, _ = run_plan("a3-k8s", ["--pid", "2108", "--npu", "10", "--pool-source", "cpuset"])
    assert code == 0 and plan["npus"]["10"]["pool"] == list(range(400, 440))
    assert plan["pool_source"]["requested"] == "cpuset"


def test_explain_names_the_source_and_the_evidence():
    from ascendbind.discovery.gather.host import discover_host

    src = SnapshotHost(f"{HOSTS}/a3-k8s")
    host = discover_host(src, Config())
    for pid, npu, expect in ((2105, 5, "pools: the worker's own cpuset (pool_source auto): kubelet's static CPU "
                                       f"manager gives container 'vllm' of pod {UID} CPUs 200-239"),
                             (2107, 7, "pools: the placement rules (pool_source auto): no proof the worker's CPUs")):
        w = discover_worker(src, pid, Config())
        plan = make_plan(host, w, [npu], Config())
        assert expect in explain_plan(host, w, plan, Config())


# ---------------------------------------------------------------- the planner, plain values


def own(cpus):
    return dataclasses.replace(worker(cpus), allowed_source="cgroup",
                               pool_evidence=PoolEvidence(True, "kubelet_checkpoint", "test"))


def test_slice_is_the_placement_rules_whatever_the_evidence():
    w = own(range(200, 240))
    plan = make_plan(a3_host(), w, [5], Config(pool_source="slice"))
    assert plan.errors[0].code == "slice_too_small" and plan.pool_source is None


def test_two_npus_split_the_cpuset_in_logical_order():
    plan = make_plan(a3_host(), own(range(200, 240)), [9, 5], Config())
    assert plan.npu(5).pool == tuple(range(200, 220)) and plan.npu(9).pool == tuple(range(220, 240))


def test_alignment_of_a_cpuset_pool_is_judged_against_the_npu_affinity():
    # NPU 0's affinity is node 6 (144-167); a pod on node 0 is planned, not aligned, with the reason
    plan = make_plan(a2_host(), own(range(0, 12)), [0], Config())
    assert plan.npu(0).pool == tuple(range(12))
    al = plan.alignment.npus[0]
    assert not al.aligned and "device wants NUMA 6" in al.reason
    # a policy that aligns never reaches outside the cpuset: refused rather than moved
    strict = make_plan(a2_host(), own(range(0, 12)), [0], Config(topology_policy="restricted"))
    assert strict.npus == () and strict.errors[0].code == "topology_rejected"
    # a cpuset across two nodes is cut to the NPU's node under best-effort, still inside the cpuset
    both = make_plan(a2_host(), own(range(140, 172)), [0], Config(topology_policy="best-effort"))
    assert both.npu(0).pool == tuple(range(144, 168))


def test_unknown_npu_under_cpuset_is_an_error():
    plan = make_plan(a3_host(), own(range(200, 240)), [16], Config())
    assert plan.errors[0].code == "unknown_npu"


# ---------------------------------------------------------------- the checkpoint parser


def test_v2_checkpoint_and_both_cgroup_drivers():
    state = parse_cpu_manager_state(checkpoint({UID: {"vllm": "200-239", "side": "240-241"}}))
    assert state.version == 2 and state.policy == "static" and 300 in state.default_cpus
    assert kubelet_place(SYSTEMD) == kubelet_place(f"/kubepods/pod{UID}/{CID}")
    assert kubelet_place(SYSTEMD).pod_uid == UID and kubelet_place(SYSTEMD).container_id == CID
    burst = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/docker-{CID}.scope"
    assert kubelet_place(burst).pod_uid == UID
    assert kubelet_place(f"/kubepods/besteffort/pod{UID}/crio-{CID}.scope").container_id == CID
    for path in ("/", "/system.slice/docker-" + CID + ".scope", f"/user.slice/pod{UID}", None, ""):
        assert kubelet_place(path).pod_uid is None
    # a user's delegated cgroup may hold any tree, and any cpuset its parent has: no proof
    delegated = f"/user.slice/user-1234.slice/user@1234.service/kubepods/pod{UID}/{CID}"
    assert kubelet_place(delegated).pod_uid is None
    assert not judge_own_cpus(state, None, delegated, r(200, 239), True).own
    ev = judge_own_cpus(state, None, SYSTEMD, r(200, 239), True)
    assert ev.own and "container 'vllm'" in ev.detail


def test_a_static_pods_checkpoint_entry_is_keyed_by_its_undashed_uid():
    """A static pod without metadata.uid: the kubelet's own UID, 32 hex digits, keys the
    checkpoint and names the pod's cgroup under either driver."""
    static = "0cf61a0b94befc6af8ecafeed1af66ce"
    state = parse_cpu_manager_state(checkpoint({static: {"work": "200-239"}}))
    for path in (f"/kubepods/pod{static}/{CID}",
                 f"/kubepods.slice/kubepods-pod{static}.slice/cri-containerd-{CID}.scope"):
        ev = judge_own_cpus(state, None, path, r(200, 239), True)
        assert ev.own and f"container 'work' of pod {static}" in ev.detail
    # another static pod's entry is not this one's
    assert not judge_own_cpus(state, None, f"/kubepods/pod{'1' * 32}/{CID}", r(200, 239), True).own


def test_v1_checkpoint_matches_the_container_id():
    state = parse_cpu_manager_state(checkpoint({CID: "200-239"}))
    assert state.version == 1
    assert judge_own_cpus(state, None, SYSTEMD, r(200, 239), True).own
    assert not judge_own_cpus(state, None, SYSTEMD.replace(CID, "b" * 64), r(200, 239), True).own


@pytest.mark.parametrize(("state", "cpus", "from_cgroup", "why"), [
    (checkpoint({UID: {"vllm": "200-239"}}), r(200, 219), True, "is exactly the worker's cpuset"),
    (checkpoint({UID: {"vllm": "200-239"}}, default="0-639"), r(200, 239), True, "also in its shared pool"),
    (checkpoint({UID: {"vllm": "200-239"}}, policy="none"), r(200, 239), True, "not static"),
    (checkpoint({"0a9e8d7c-6b5a-4f3e-8d2c-1b0a9f8e7d6c": {"vllm": "200-239"}}), r(200, 239), True, "no exclusive"),
    (checkpoint({UID: {"vllm": "200-239"}}), r(200, 239), False, "cgroup cpuset is unreadable"),
    (None, r(200, 239), True, "no checkpoint here"),
])
def test_what_is_not_proof(state, cpus, from_cgroup, why):
    parsed = parse_cpu_manager_state(state) if state else None
    ev = judge_own_cpus(parsed, "no checkpoint here", SYSTEMD, cpus, from_cgroup)
    assert not ev.own and ev.proof == "none" and why in ev.detail


@pytest.mark.parametrize("text", [
    "", "[]", "null", "{", "[" * 100000, json.dumps({"policyName": 3}),
    json.dumps({"policyName": "static", "defaultCpuSet": "0-99999999"}),
    json.dumps({"policyName": "static", "entries": []}),
    json.dumps({"policyName": "static", "entries": {UID: 5}}),
    json.dumps({"policyName": "static", "entries": {UID: {"a": 1}}}),
    json.dumps({"policyName": "static", "entries": {UID: {"a": "1"}, CID: "2"}}),
    json.dumps({"policyName": "static", "entries": {f"p{i}": "0" for i in range(5000)}}),
    json.dumps({"policyName": "x" * 5000}),
    " " * (CHECKPOINT_LIMIT + 1),
])
def test_hostile_checkpoints_are_parse_errors(text):
    with pytest.raises(ParseError) as e:
        parse_cpu_manager_state(text, "/var/lib/kubelet/cpu_manager_state")
    assert "/var/lib/kubelet/cpu_manager_state" in str(e.value) and len(str(e.value)) < 400


def test_only_the_worker_pods_cpu_lists_are_parsed():
    # 4000 pods with the widest list a kernel can name cost nothing unless one is the worker's
    many = {f"{i:08x}-0000-4000-8000-000000000000": {"c": "0-65535"} for i in range(4000)}
    state = parse_cpu_manager_state(checkpoint({**many, UID: {"vllm": "200-239"}}))
    assert judge_own_cpus(state, None, SYSTEMD, r(200, 239), True).own
    bad = parse_cpu_manager_state(checkpoint({UID: {"vllm": "200-9x"}}))
    with pytest.raises(ParseError):
        judge_own_cpus(bad, None, SYSTEMD, r(200, 239), True)


def test_a_malformed_checkpoint_is_no_proof_and_says_so(tmp_path):
    import shutil

    snap = tmp_path / "a3"
    shutil.copytree(f"{HOSTS}/a3-k8s", snap)
    (snap / "var/lib/kubelet/cpu_manager_state").write_text('{"policyName": "static", "entries": [')
    w = discover_worker(SnapshotHost(str(snap)), 2105, Config())
    assert not w.pool_evidence.own and "not JSON" in w.pool_evidence.detail
    (snap / "var/lib/kubelet/cpu_manager_state").unlink()
    w = discover_worker(SnapshotHost(str(snap)), 2105, Config())
    assert "is absent or unreadable" in w.pool_evidence.detail
    # slice never reads it
    assert discover_worker(SnapshotHost(str(snap)), 2105, Config(pool_source="slice")).pool_evidence is None


# ---------------------------------------------------------------- config


def test_pool_source_is_a_checked_key_from_every_layer():
    assert Config().pool_source == "auto"
    assert load_config(None, env={"ASCENDBIND_POOL_SOURCE": "cpuset"}).pool_source == "cpuset"
    with pytest.raises(ConfigError) as e:
        load_config(None, env={"ASCENDBIND_POOL_SOURCE": "own"})
    assert "pool_source" in str(e.value) and "auto, slice, cpuset" in str(e.value)
    with pytest.raises(ConfigError):
        Config(pool_source="slices")


# ---------------------------------------------------------------- cgroup v2 outside the reader's namespace

MOUNTINFO = (
    "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
    "31 25 0:26 /../pod/ctr /sys/fs/cgroup ro,nosuid,nodev,noexec - cgroup2 cgroup2 rw,nsdelegate\n"
    "32 25 0:26 /../pod/ctr/inner\\040dir /mnt/with\\040space rw - cgroup2 cgroup2 rw\n"
    "33 25 0:27 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
)


def test_mountinfo_cgroup2_mounts_are_located_by_the_kernels_paths():
    from ascendbind.discovery.parse.mountinfo import cgroup2_mounts, locate_cgroup

    mounts = cgroup2_mounts(MOUNTINFO + "garbage line\n34 25 0:26 / ../escape rw - cgroup2 c rw\n")
    assert [m.mount_point for m in mounts] == ["/sys/fs/cgroup", "/mnt/with space"]
    assert locate_cgroup("/../pod/ctr", mounts) == ("/sys/fs/cgroup", "")
    assert locate_cgroup("/../pod/ctr/sub/leaf", mounts) == ("/sys/fs/cgroup", "/sub/leaf")
    assert locate_cgroup("/../pod/ctr/inner dir/x", mounts) == ("/mnt/with space", "/x")
    assert locate_cgroup("/../pod/other", mounts) is None and locate_cgroup("/../pod/ctrl", mounts) is None


def test_a_worker_outside_the_readers_cgroup_namespace_is_read_through_its_own_mount(tmp_path):
    snap = tmp_path / "host"
    proc = snap / "proc" / "4242"
    (proc / "root/sys/fs/cgroup").mkdir(parents=True)
    (proc / "status").write_text("Name:\tpython3\nTgid:\t4242\nCpus_allowed_list:\t0-639\nMems_allowed_list:\t0-7\n")
    (proc / "cgroup").write_text("0::/../pod/ctr\n")
    (proc / "mountinfo").write_text(MOUNTINFO)
    (proc / "root/sys/fs/cgroup/cpuset.cpus.effective").write_text("200-239\n")
    w = discover_worker(SnapshotHost(str(snap)), 4242, Config(), want_devices=False)
    assert w.allowed_source == "cgroup" and w.allowed_cpus == r(200, 239)
    # without a mount of the worker's that holds its cgroup: Cpus_allowed_list, as before
    (proc / "mountinfo").write_text(MOUNTINFO.replace("/../pod/ctr ", "/../pod/elsewhere ", 1))
    w = discover_worker(SnapshotHost(str(snap)), 4242, Config(), want_devices=False)
    assert w.allowed_source == "status" and w.allowed_cpus == r(0, 639)
