"""A real kubelet 1.20.2 with the static CPU manager on containerd (tests/kubenode.py): what it
does to a Guaranteed pod (an exclusive CPU in its checkpoint, its cgroup's cpuset, the
process's affinity), the UID forms a static pod can have, a kubelet restart and a container
restart, and a node's life leaving the machine as it found it.

Every test but the last shares one node (a module-scoped fixture); each removes its pods.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import psutil
import pytest

from ascendbind.values.cpulist import parse_cpulist
from tests import kubenode
from tests.cpuset_cgroups import kubepods_lock

WHY = kubenode.why_not()
if WHY and not os.environ.get("CI"):
    pytestmark = pytest.mark.skip(reason=WHY)

# the UID form the API server gives a pod (a static pod with metadata.uid set keeps it)
API_UID = "3f9d2c4e-8b1a-4c7e-9f20-5d6e7a8b9c01"


def _online() -> frozenset[int]:
    with open("/sys/devices/system/cpu/online") as fh:
        return parse_cpulist(fh.read().strip())


@pytest.fixture(scope="module")
def shared():
    if WHY:
        pytest.fail(f"CI is set and no kubelet node can run here: {WHY}")
    holder = kubenode.SharedNode()
    yield holder
    holder.close()


@pytest.fixture
def node(shared):
    return shared.get()


def guaranteed(name: str, uid: str | None = None) -> dict:
    """A Guaranteed pod (requests = limits, a whole CPU): the static policy gives its
    container a CPU of its own."""
    metadata = {"name": name, "namespace": "default", **({"uid": uid} if uid else {})}
    resources = {"cpu": "1", "memory": "64Mi"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {
        "hostNetwork": True, "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "work", "image": kubenode.BUSYBOX, "imagePullPolicy": "Never",
                        # what the container itself sees, in its log; then a process that stays
                        "command": ["/bin/sh", "-c", "grep Cpus_allowed_list /proc/self/status; exec sleep 100000"],
                        "resources": {"requests": resources, "limits": dict(resources)}}]}}


def _exclusive_cpu(node: kubenode.Node, uid: str) -> int:
    entry = node.wait_for(f"checkpoint entry of pod {uid}",
                          lambda: (node.checkpoint().get("entries") or {}).get(uid), 30)
    cpus = parse_cpulist(entry["work"])
    assert len(cpus) == 1, entry
    return next(iter(cpus))


def _cpuset_of(pid: int) -> tuple[str, frozenset[int]]:
    path = kubenode.Node.cgroup_of(pid)["cpuset"]
    with open(f"/sys/fs/cgroup/cpuset{path}/cpuset.cpus") as fh:
        return path, parse_cpulist(fh.read().strip())


def _affinity(pid: int) -> frozenset[int]:
    with open(f"/proc/{pid}/status") as fh:
        return parse_cpulist(re.search(r"^Cpus_allowed_list:\s*(\S+)", fh.read(), re.M).group(1))


def test_guaranteed_pod_gets_a_cpu_of_its_own_and_gives_it_back(node):
    uid = node.add_pod(guaranteed("pinned"))
    try:
        assert re.fullmatch(r"[0-9a-f]{32}", uid), uid  # a static pod's UID: the manifest's hash
        pid = node.wait_container("pinned", "work")
        cpu = _exclusive_cpu(node, uid)
        state = node.checkpoint()
        assert state["policyName"] == "static"
        assert cpu not in parse_cpulist(state["defaultCpuSet"]), state
        assert 0 in parse_cpulist(state["defaultCpuSet"]), state  # the reserved CPU stays shared
        path, cpus = _cpuset_of(pid)
        assert re.fullmatch(rf"/kubepods/pod{uid}/[0-9a-f]{{64}}", path), path
        assert cpus == {cpu}
        assert _affinity(pid) == {cpu}
        node.wait_for("the container's log", lambda: "Cpus_allowed_list" in node.container_log("pinned", "work"), 30)
        assert re.search(rf"stdout F Cpus_allowed_list:\t{cpu}$", node.container_log("pinned", "work"), re.M)
    finally:
        node.remove_pod("pinned")
    state = node.checkpoint()
    assert uid not in (state.get("entries") or {}), state
    node.wait_for("defaultCpuSet whole again", lambda: parse_cpulist(node.checkpoint()["defaultCpuSet"]) == _online(), 30)


def test_static_pod_keeps_an_api_server_uid(node):
    uid = node.add_pod(guaranteed("apiuid", uid=API_UID))
    try:
        assert uid == API_UID
        pid = node.wait_container("apiuid", "work")
        cpu = _exclusive_cpu(node, API_UID)
        path, cpus = _cpuset_of(pid)
        assert re.fullmatch(rf"/kubepods/pod{API_UID}/[0-9a-f]{{64}}", path), path
        assert cpus == {cpu} and _affinity(pid) == {cpu}
    finally:
        node.remove_pod("apiuid")
    assert API_UID not in (node.checkpoint().get("entries") or {})


def _synced_running(node: kubenode.Node, pod: str, restarts: int) -> str | None:
    """The container ID the kubelet reports running for ``work`` once it counts ``restarts``."""
    status = node.pod_status(pod)
    for c in (status or {}).get("containerStatuses", []):
        if c["name"] == "work" and "running" in c.get("state", {}) and c.get("restartCount") == restarts:
            return c["containerID"]
    return None


def test_kubelet_restart_keeps_the_pod_running(node):
    uid = node.add_pod(guaranteed("survivor"))
    try:
        pid = node.wait_container("survivor", "work")
        cpu = _exclusive_cpu(node, uid)
        before = node.wait_for("the kubelet's status of survivor", lambda: _synced_running(node, "survivor", 0), 60)
        old_kubelet = node.kubelet_pid
        node.restart_kubelet()
        assert node.kubelet_pid != old_kubelet
        # the new kubelet has synced the pod and adopted the running container as it was
        after = node.wait_for("the new kubelet's status of survivor",
                              lambda: _synced_running(node, "survivor", 0), 60)
        assert after == before
        assert node.wait_container("survivor", "work", timeout=10) == pid
        assert _exclusive_cpu(node, uid) == cpu and _affinity(pid) == {cpu}
    finally:
        node.remove_pod("survivor")


def test_killed_container_is_restarted_on_its_cpu(node):
    uid = node.add_pod(guaranteed("phoenix"))
    try:
        pid = node.wait_container("phoenix", "work")
        cpu = _exclusive_cpu(node, uid)
        assert node.kill_container("phoenix", "work") == pid
        new = node.wait_container("phoenix", "work", other_than=pid)
        assert new != pid
        node.wait_for("restartCount 1", lambda: _synced_running(node, "phoenix", 1), 60)
        path, cpus = _cpuset_of(new)
        assert path.startswith(f"/kubepods/pod{uid}/") and cpus == {cpu} and _affinity(new) == {cpu}
    finally:
        node.remove_pod("phoenix")


# --- a node's life leaves the machine as it found it --------------------------------------------

OUTSIDE = ("/var/lib/kubelet", kubenode.DEVICE_PLUGINS, kubenode.POD_LOGS, kubenode.CONTAINER_LOGS,
           "/run/containerd", "/var/lib/containerd", "/opt/containerd")


NODE_DIRS = os.path.join(tempfile.gettempdir(), "ascendbind-kube-")


def _mounts() -> set[str]:
    """The mount table's lines a node could add: under a node's dir, over /proc/sys, the kubelet's
    and containerd's host paths, overlays (other tests on this machine mount elsewhere)."""
    watched = (NODE_DIRS, "/proc/sys", "/var/lib/kubelet", "/var/log", "/run/containerd", "/sys/fs/cgroup")
    with open("/proc/self/mountinfo") as fh:
        return {line for line in fh
                if line.split()[4].startswith(watched) or " - overlay " in line}


def _snapshot() -> dict:
    def listing(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else None
    sysctls = {}
    for name in kubenode.SYSCTLS:
        with open(f"/proc/sys/{name}") as fh:
            sysctls[name] = fh.read().strip()
    return {
        "sysctls": sysctls,
        "mounts": _mounts(),
        "kubepods": kubenode._kubepods(),
        "outside": {p: listing(p) for p in OUTSIDE},
        "children": sorted((c.pid, c.name()) for c in psutil.Process().children(recursive=True)),
        "naming a node dir": _naming(),
    }


def _naming() -> list[int]:
    """Pids whose command line names a node's dir (its shims, containerd, kubelet)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(NODE_DIRS in arg for arg in proc.info["cmdline"] or ()):
            found.append(proc.pid)
    return found


def test_a_node_leaves_the_machine_as_it_found_it(shared):
    shared.close()  # this test's node is the only one: nodes are serialised machine-wide
    with kubepods_lock():  # no other node comes or goes between the two looks
        before = _snapshot()
        with kubenode.kube_node(lock=False) as node:
            uid = node.add_pod(guaranteed("tidy"))
            pid = node.wait_container("tidy", "work")
            _exclusive_cpu(node, uid)
            during = _snapshot()
            # the kubelet sees the values it wants, in its own mount namespace only
            for name, value in kubenode.SYSCTLS.items():
                inside = subprocess.run(["nsenter", "-t", str(node.kubelet_pid), "-m", "cat", f"/proc/sys/{name}"],
                                        capture_output=True, text=True, check=True).stdout.strip()
                assert inside == value, name
            node_dir = node.dir
        after = _snapshot()
    # the looks can tell: the node's traces were there while it ran
    assert during["kubepods"] and during["naming a node dir"] and during["children"] != before["children"]
    assert during["mounts"] != before["mounts"] and during["outside"] != before["outside"]
    for what in before:
        assert after[what] == before[what], what
    assert before["kubepods"] == [] and not os.path.exists(node_dir) and not psutil.pid_exists(pid)


# a test process that starts a node and is then killed (as a time limit kills a run)
_DOOMED = """
import json, sys
from tests import kubenode
held = kubenode.kube_node()  # never left: the process is killed with its node up
node = held.__enter__()
node.add_pod(json.loads(sys.argv[1]))
pid = node.wait_container("orphan", "work")
print("NODE " + json.dumps({"dir": node.dir, "pids": [pid, node.kubelet_pid, node.containerd_pid]}), flush=True)
sys.stdin.read()
"""


def test_a_node_whose_test_process_died_is_torn_down_by_the_next(shared):
    shared.close()
    child = subprocess.Popen([sys.executable, "-c", _DOOMED, json.dumps(guaranteed("orphan"))], cwd=kubenode.REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": kubenode.REPO})
    try:
        lines = iter(child.stdout.readline, "")  # ends when the child exits
        started = next((json.loads(line[5:]) for line in lines if line.startswith("NODE ")), None)
        assert started, f"the child's node did not start (exit {child.poll()})"
    finally:
        child.kill()
        child.wait()
    assert all(psutil.pid_exists(p) for p in started["pids"]) and kubenode._kubepods()  # orphans now
    said: list[str] = []
    with kubenode.kube_node(log=said.append) as node:
        assert said == [f"kubenode: tore down {started['dir']}, left by pid {child.pid}"]  # nothing left over
        assert not os.path.exists(started["dir"])
        assert not any(psutil.pid_exists(p) for p in started["pids"])
        assert node.checkpoint()["policyName"] == "static"
    assert kubenode._kubepods() == [] and not _naming()
