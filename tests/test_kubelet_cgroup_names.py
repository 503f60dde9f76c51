"""Every cgroup layout a kubelet makes, read back by the one rule (``kubelet_place``) that
names a worker's pod and container and picks its checkpoint entry.

This machine's real kubelet shows cgroup v1 with the cgroupfs driver (test_kube_node.py,
test_kube_daemonset.py). The systemd driver and cgroup v2 are derived from how current
kubelets and runtimes name cgroups (tests/kubelet_names.py): both drivers, containerd,
CRI-O and cri-dockerd, the three QoS classes, both UID forms (the API server's UUID, a
static pod's 32 hex digits), read on v1, on v2, and from a DaemonSet container's own
cgroup namespace.
"""

from __future__ import annotations

import itertools
import os

import pytest

from ascendbind.discovery.gather.cpuusage import pod_names
from ascendbind.discovery.parse.kubelet import judge_own_cpus, kubelet_place, parse_cpu_manager_state
from tests.kubelet_names import cgroup_parts, container_path, as_seen_from, systemd_path

API_UID = "5f3c1b2a-9d4e-4c7f-8a6b-0e1d2c3b4a59"
STATIC_UID = "0cf61a0b94befc6af8ecafeed1af66ce"
CID = "4e" * 32
LAYOUTS = [(d, r) for d in ("cgroupfs", "systemd") for r in ("containerd", "cri-o", "cri-dockerd")]


def test_the_derivation_gives_the_kubelets_own_example():
    # the example in the kubelet's CgroupName documentation
    assert systemd_path(["kubepods", "burstable", "pod1234-abcd-5678-efgh"]) == \
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_abcd_5678_efgh.slice"
    assert container_path("systemd", "containerd", "guaranteed", STATIC_UID, CID) == \
        f"/kubepods.slice/kubepods-pod{STATIC_UID}.slice/cri-containerd-{CID}.scope"
    assert as_seen_from("/a/b/c/d", "/a/x/y") == "/../../b/c/d"


@pytest.mark.parametrize(("driver", "runtime", "qos", "uid"), [
    (d, r, q, u) for (d, r), q, u in itertools.product(LAYOUTS, ("guaranteed", "burstable", "besteffort"),
                                                      (API_UID, STATIC_UID))])
def test_every_layout_names_the_pod_and_container(driver, runtime, qos, uid):
    path = container_path(driver, runtime, qos, uid, CID)
    assert (kubelet_place(path).pod_uid, kubelet_place(path).container_id) == (uid, CID)
    # the DaemonSet's container on cgroup v2 reads it from its own cgroup namespace, rooted at
    # its own container's cgroup in another pod (a Burstable one, as the DaemonSet's is)
    reader = container_path(driver, runtime, "burstable", "7" * 32, "9a" * 32)
    seen = as_seen_from(path, reader)
    assert seen.startswith("/..") and kubelet_place(seen).pod_uid == uid
    # a user's delegated cgroup holding the same tree proves nothing
    assert kubelet_place("/user.slice/user-1234.slice/user@1234.service" + path).pod_uid is None
    # the pod's own cgroup (a process the runtime left there) names the pod and no container
    pod = container_path(driver, runtime, qos, uid, CID).rsplit("/", 1)[0]
    assert (kubelet_place(pod).pod_uid, kubelet_place(pod).container_id) == (uid, None)


@pytest.mark.parametrize(("driver", "runtime"), LAYOUTS)
@pytest.mark.parametrize("uid", [API_UID, STATIC_UID])
def test_the_checkpoint_entry_of_the_pod_proves_its_cpus_in_every_layout(driver, runtime, uid):
    """The checkpoint keys pods by UID as the kubelet has it; the cgroup may spell it with _."""
    state = parse_cpu_manager_state(
        '{"policyName":"static","defaultCpuSet":"0,5-7","entries":{"%s":{"vllm":"1-4"}},"checksum":1}' % uid)
    path = container_path(driver, runtime, "guaranteed", uid, CID)
    ev = judge_own_cpus(state, None, path, frozenset(range(1, 5)), True)
    assert ev.own, ev.detail
    other = container_path(driver, runtime, "guaranteed", API_UID if uid == STATIC_UID else STATIC_UID, CID)
    assert not judge_own_cpus(state, None, other, frozenset(range(1, 5)), True).own


@pytest.mark.parametrize("uid", [API_UID, STATIC_UID])
@pytest.mark.parametrize("v2", [False, True])
def test_pod_names_in_every_layout(tmp_path, uid, v2):
    """The names come from the kubelet's log directories, tied by the UID and container ID."""
    for n, (driver, runtime) in enumerate(LAYOUTS):
        pid = 100 + n
        path = container_path(driver, runtime, "burstable", uid, CID)
        lines = f"0::{path}\n" if v2 else "".join(f"{i}:{c}:{path}\n" for i, c in ((7, "memory"), (3, "cpuset")))
        os.makedirs(tmp_path / "proc" / str(pid), exist_ok=True)
        (tmp_path / "proc" / str(pid) / "cgroup").write_text(lines + ("" if v2 else "0::/\n"))
    logs = tmp_path / "log"
    (logs / "containers").mkdir(parents=True)
    (logs / "pods" / f"infer_vllm-0_{uid}" / "engine").mkdir(parents=True)
    (logs / "containers" / f"vllm-0_infer_engine-{CID}.log").symlink_to(f"/var/log/pods/infer_vllm-0_{uid}/engine/0.log")
    for n in range(len(LAYOUTS)):
        assert pod_names(100 + n, str(tmp_path / "proc"), str(logs)) == \
            {"namespace": "infer", "pod_name": "vllm-0", "container_name": "engine"}, LAYOUTS[n]


def test_parts_follow_the_qos_class():
    assert cgroup_parts("guaranteed", STATIC_UID) == ["kubepods", "pod" + STATIC_UID]
    assert cgroup_parts("besteffort", API_UID) == ["kubepods", "besteffort", "pod" + API_UID]
