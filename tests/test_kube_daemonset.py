"""The daemon as operators run it: a pod of a real kubelet (v1.20, static CPU manager,
cgroupfs, containerd + runc), from the image deploy/kubernetes/Containerfile builds,
with the DaemonSet's own pod spec; workers as Guaranteed and Burstable pods that bind
themselves with ``ascendbind run``.

The node is tests/kubenode.py's (everything under a temporary directory, nothing of it
left behind), the image tests/kube_image.py's (built here from a Debian base, no
registry). The daemon's pod is ``deploy/kubernetes/daemonset.yaml``'s template with only
the changes tests/kube_pods.py lists (no CNI, no NPU, no API server for a ConfigMap, the
test's own host directories). The fixture npu-smi describes this machine as two NPUs, NPU 0
next to CPU 1 and NPU 1 next to CPU 0; the kubelet keeps CPU 0 for the system, so a
Guaranteed pod of one CPU gets CPU 1 for itself, and a Burstable pod runs on CPU 0.

The tests share one node and one daemon pod (a test that kills the daemon's container
leaves the kubelet to start another; each test waits for a healthy daemon first). Each
test starts its own worker pods and removes them, so they run in any order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import tomllib
import urllib.request
from dataclasses import dataclass

import pytest

from ascendbind.client import Client
from ascendbind.values.cpulist import parse_cpulist
from tests import kube_image, kubenode
from tests.daemon_harness import FIXTURE_BIN, free_port, metric_value, wait_for
from tests.kube_pods import (CHANGES, CONFIG_CHANGES, WORKER_FILES, HostDirs, changed_keys, configmap_toml,
                             daemon_config, daemon_pod, worker_pod)
from tests.workers import cpus_allowed_of

pytestmark = pytest.mark.skipif(kubenode.why_not() is not None and not os.environ.get("CI"),
                                reason=str(kubenode.why_not()))

DAEMON = ("ascendbind", "ascendbind")  # the DaemonSet's pod name and container name
# the capabilities the DaemonSet adds, as bits of CapEff: DAC_OVERRIDE 1, SYS_PTRACE 19, SYS_NICE 23
CAP_BITS = {1, 19, 23}
API_UID = "6a1f0c2e-3b4d-4e5f-8a9b-0c1d2e3f4a5b"
WAIT = 120.0


@dataclass
class Stack:
    node: kubenode.Node
    image: str
    pod: dict
    dirs: HostDirs
    metrics_port: int
    worker_dir: str
    kills: int = 0  # how often a test killed the daemon's container

    @property
    def client(self) -> Client:
        return Client(os.path.join(self.dirs.run, "ascendbind.sock"), timeout=20)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def worker(self, pid: int) -> dict | None:
        try:
            listing = self.client.workers()["workers"]
        except OSError:
            return None
        return next((w for w in listing if w["pid"] == pid), None)

    def why(self) -> str:
        return self.node.log() + "\n--- the daemon's log, last lines:\n" + \
            "\n".join(self.node.container_log(*DAEMON).splitlines()[-30:])


def _dirs(base: str) -> HostDirs:
    names = ("config", "run", "state", "sbin", "empty")
    for n in names:
        os.mkdir(os.path.join(base, n), 0o755)
    shutil.copy(FIXTURE_BIN / "npu-smi", os.path.join(base, "sbin", "npu-smi"))
    os.chmod(os.path.join(base, "sbin", "npu-smi"), 0o755)
    return HostDirs(*(os.path.join(base, n) for n in names))


@pytest.fixture(scope="module")
def stack():
    archive, ref = kube_image.daemon_image()
    base = tempfile.mkdtemp(prefix="ascendbind-kube-")
    os.chmod(base, 0o755)
    try:
        dirs = _dirs(base)
        worker_dir = os.path.join(base, "worker")
        os.mkdir(worker_dir, 0o755)
        for path in WORKER_FILES:
            shutil.copy(path, worker_dir)
        with kubenode.kube_node(labels={"ascendbind.io/enabled": "true"}) as node:
            node.import_image(archive)
            port = free_port()
            with open(os.path.join(dirs.config, "config.toml"), "w") as fh:
                fh.write(daemon_config(node.kubelet_root, port, node.containerd_pid))
            pod = daemon_pod(ref, dirs)
            node.add_pod(pod)
            node.wait_container(*DAEMON, timeout=WAIT)
            s = Stack(node, ref, pod, dirs, port, worker_dir)
            assert wait_for(lambda: _healthy(s), WAIT), s.why()
            yield s
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _healthy(s: Stack) -> bool:
    try:
        return bool(s.client.health())
    except Exception:  # noqa: BLE001 - not up yet: any error is "not yet"
        return False


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


def _masks(pid: int) -> dict[int, frozenset[int] | None]:
    return {int(t): cpus_allowed_of(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def _thread_names(pid: int) -> set[str]:
    out = set()
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as fh:
                out.add(fh.read().strip())
        except OSError:
            pass
    return out


def _ready(node, pod: str, container: str) -> bool | None:
    """The kubelet's own view of a container's readiness (its probes), from its /pods."""
    status = node.pod_status(pod) or {}
    return next((c.get("ready") for c in status.get("containerStatuses", []) if c["name"] == container), None)


def _worker_of(s: Stack, runner: int) -> int:
    """The worker ``ascendbind run`` (the container's process) forked, bound and exec'd."""
    def child() -> int | None:
        try:
            with open(f"/proc/{runner}/task/{runner}/children") as fh:
                kids = fh.read().split()
        except OSError:
            return None
        return int(kids[0]) if len(kids) == 1 else None
    assert wait_for(child, WAIT), s.why()
    return child()


def _start_worker(s: Stack, name: str, *, guaranteed: bool, cpu: str, npu: str,
                  uid: str | None = None) -> tuple[str, int]:
    pod_uid = s.node.add_pod(worker_pod(name, s.image, socket_dir=s.dirs.run, worker_dir=s.worker_dir, cpu=cpu,
                                        guaranteed=guaranteed, uid=uid, npu=npu))
    pid = _worker_of(s, s.node.wait_container(name, "engine", timeout=WAIT))
    want = {"acl_thread", "release_thread", "worker_0"}
    assert wait_for(lambda: want <= _thread_names(pid), WAIT), (_thread_names(pid), s.why())
    return pod_uid, pid


# ----------------------------------------------------------------------------- the daemon's pod


def test_the_daemon_pod_is_the_daemonsets_own_but_for_the_listed_changes(stack):
    assert changed_keys(stack.pod) == set(CHANGES)
    with open(os.path.join(stack.dirs.config, "config.toml"), "rb") as fh:
        ours = tomllib.load(fh)
    theirs = tomllib.loads(configmap_toml())
    assert {k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)} == set(CONFIG_CHANGES)


def test_the_daemon_runs_from_its_image_with_the_daemonsets_privileges_and_its_probes_answer(stack):
    assert wait_for(lambda: _healthy(stack), WAIT), stack.why()
    pid = stack.node.wait_container(*DAEMON, timeout=WAIT)
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        argv = fh.read().split(b"\0")
    assert b"serve" in argv and b"/etc/ascendbind/config.toml" in argv, argv
    st = _status(pid)
    caps = int(st["CapEff"], 16)
    assert {b for b in range(64) if caps >> b & 1} == CAP_BITS, st["CapEff"]
    assert st["NoNewPrivs"].strip() == "1"  # allowPrivilegeEscalation: false
    assert st["Seccomp"].strip() == "0"  # seccompProfile: Unconfined (migrate_pages)
    # hostPID: the daemon sees the host's pids; its root file system is read-only
    assert os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
    with open(f"/proc/{pid}/mountinfo") as fh:
        root = [line.split() for line in fh if line.split()[4] == "/"]
    assert root and "ro" in root[-1][5].split(","), root
    # the readiness probe runs in the container and the kubelet says so
    assert wait_for(lambda: _ready(stack.node, *DAEMON) is True, WAIT), stack.why()
    # the liveness probe passes too: the kubelet has not restarted the container (only a test
    # that kills it does)
    status = stack.node.pod_status(DAEMON[0])["containerStatuses"][0]
    assert status["restartCount"] == stack.kills, status


# ----------------------------------------------------------------------------- a Guaranteed worker


@pytest.fixture
def guaranteed(stack):
    """The Guaranteed worker pod (cpu: 1), bound: its pod UID, pid, and the CPU the kubelet
    gave it; removed afterwards unless the test removed it."""
    assert wait_for(lambda: _healthy(stack), WAIT), stack.why()
    uid, pid = _start_worker(stack, "vllm-0", guaranteed=True, cpu="1", npu="0")
    try:
        entries = stack.node.checkpoint().get("entries", {})
        assert uid in entries and "engine" in entries[uid], (uid, entries)
        assert wait_for(lambda: stack.worker(pid) is not None, WAIT), stack.why()
        yield uid, pid, int(entries[uid]["engine"])
    finally:
        if os.path.exists(os.path.join(stack.node.manifests, "vllm-0.json")):
            stack.node.remove_pod("vllm-0")
    assert wait_for(lambda: stack.worker(pid) is None, WAIT), stack.why()


def test_a_guaranteed_worker_pod_is_bound_to_its_exclusive_cpu(stack, guaranteed):
    uid, pid, cpu = guaranteed
    assert len(uid) == 32 and "-" not in uid  # a static pod: the kubelet's hash of its manifest
    cp = stack.node.checkpoint()
    assert cpu not in parse_cpulist(cp["defaultCpuSet"]), cp
    w = stack.worker(pid)
    assert w["cpulists"]["npus"]["0"]["pool"] == str(cpu), w["cpulists"]
    # the roles inside the pool: one CPU, so they share it
    assert {w["cpulists"]["npus"]["0"][r] for r in ("main", "acl", "release")} == {str(cpu)}
    assert w["plan"]["pool_source"]["evidence"].startswith("kubelet's static CPU manager gives container 'engine' "
                                                           f"of pod {uid}"), w["plan"]["pool_source"]
    assert w["proof"]["proven"], w["proof"]
    assert set(_masks(pid).values()) == {frozenset({cpu})}, _masks(pid)
    pod = {"namespace": "inference", "pod_name": stack.node.pod_name("vllm-0"), "container_name": "engine"}
    assert w["contention"]["pod"] == pod, w["contention"]
    assert metric_value(stack.metrics(), "ascendbind_worker_info", pid=str(pid), npu="0", **pod) == 1.0


def _rebinds(s: Stack) -> float:
    """Bindings made again because the worker's cpuset or kubelet's checkpoint changed."""
    text = s.metrics()
    return sum(metric_value(text, "ascendbind_replans_total", reason=r, outcome="rebound") or 0.0
               for r in ("cpuset_changed", "checkpoint_changed"))


def test_a_kubelet_restart_keeps_the_pods_and_their_bindings(stack, guaranteed):
    """The pods keep running and the worker stays bound to its CPU. A kubelet that starts
    again reconciles its containers' cpusets; on a loaded machine the daemon was seen to
    bind the worker again once in that window (its cpuset or the checkpoint changed under
    it): that is allowed when the daemon counts it as such a re-plan, and only then."""
    _uid, pid, cpu = guaranteed
    daemon = stack.node.wait_container(*DAEMON, timeout=WAIT)
    before, rebinds = stack.worker(pid), _rebinds(stack)
    stack.node.restart_kubelet()
    assert _worker_of(stack, stack.node.wait_container("vllm-0", "engine", timeout=WAIT)) == pid
    assert stack.node.wait_container(*DAEMON, timeout=WAIT) == daemon
    assert wait_for(lambda: _ready(stack.node, *DAEMON) is True, WAIT), stack.why()
    # settled: the same CPUs as before, every thread on its CPU, listed once
    assert wait_for(lambda: stack.worker(pid)["cpulists"] == before["cpulists"]
                    and set(_masks(pid).values()) == {frozenset({cpu})}, WAIT), stack.why()
    assert [w["pid"] for w in stack.client.workers()["workers"]].count(pid) == 1
    after = stack.worker(pid)
    assert after["bound_at"] == before["bound_at"] or _rebinds(stack) > rebinds, (before, after, stack.why())


def test_the_daemons_container_killed_comes_back_with_its_bindings_from_the_host(stack, guaranteed):
    _uid, pid, cpu = guaranteed
    before = stack.worker(pid)
    old = stack.node.kill_container(*DAEMON)
    stack.kills += 1
    new = stack.node.wait_container(*DAEMON, timeout=WAIT, other_than=old)
    assert new != old
    assert wait_for(lambda: _healthy(stack) and stack.worker(pid) is not None, WAIT), stack.why()
    listing = stack.client.workers()["workers"]
    assert [w["pid"] for w in listing].count(pid) == 1
    after = stack.worker(pid)
    # the state file on the host kept it: the same bind, not a second one
    assert after["bound_at"] == before["bound_at"] and after["cpulists"] == before["cpulists"]
    assert set(_masks(pid).values()) == {frozenset({cpu})}


# ----------------------------------------------------------------------------- a Burstable worker


def test_a_burstable_pod_with_an_api_server_uid_is_named_and_planned_by_the_placement_rules(stack, guaranteed):
    assert wait_for(lambda: _healthy(stack), WAIT), stack.why()
    uid, pid = _start_worker(stack, "vllm-b", guaranteed=False, cpu="200m", npu="1", uid=API_UID)
    try:
        assert uid == API_UID
        cg = stack.node.cgroup_of(pid)["cpuset"]
        assert cg.startswith(f"/kubepods/burstable/pod{API_UID}/"), cg
        assert API_UID not in stack.node.checkpoint().get("entries", {})
        assert wait_for(lambda: stack.worker(pid) is not None, WAIT), stack.why()
        w = stack.client.worker(pid, explain=True)
        # the placement rules: NPU 1's slice, next to it, in the shared pool
        assert w["cpulists"]["npus"]["1"]["pool"] == "0", w["cpulists"]
        assert "pool_source" not in w["plan"]
        assert f"holds no exclusive CPUs for pod {API_UID}" in w["explanation"], w["explanation"]
        pod = {"namespace": "inference", "pod_name": stack.node.pod_name("vllm-b"), "container_name": "engine"}
        assert w["contention"]["pod"] == pod
        assert metric_value(stack.metrics(), "ascendbind_worker_info", pid=str(pid), npu="1", **pod) == 1.0
        # the shared pool: never the Guaranteed pod's CPU
        assert guaranteed[2] not in set().union(*(m or set() for m in _masks(pid).values()))
    finally:
        stack.node.remove_pod("vllm-b")
    assert wait_for(lambda: stack.worker(pid) is None, WAIT), stack.why()


# ----------------------------------------------------------------------------- the pod goes


def test_a_deleted_pod_is_dropped_and_its_cpu_goes_back_to_the_shared_pool(stack, guaranteed):
    uid, pid, cpu = guaranteed
    dropped = metric_value(stack.metrics(), "ascendbind_workers_dropped_total", reason="exited") or 0.0
    stack.node.remove_pod("vllm-0")
    assert wait_for(lambda: stack.worker(pid) is None, WAIT), stack.why()
    assert uid not in stack.node.checkpoint().get("entries", {})
    assert cpu in parse_cpulist(stack.node.checkpoint()["defaultCpuSet"])
    assert wait_for(lambda: (metric_value(stack.metrics(), "ascendbind_workers_dropped_total", reason="exited")
                             or 0.0) > dropped, WAIT)
