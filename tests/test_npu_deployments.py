"""The right NPU in every deployment, for real: docs/integrations.md's table, case by case.

A real daemon (in a private mount namespace whose /proc/devices lists the NPU driver's
``devdrv-cdev`` major, which this machine's kernel lacks) binds real workers: on the
bare host, or in their own mount and pid namespace with a private /dev of
``mknod``-made davinci nodes and a cgroup v1 devices cgroup allowing just those
(tests/containers.py), with the environment the Ascend docker runtime, the device
plugin or HAMi give a container. npu-smi is the fixture one, replaying a host of 8
NPUs whose process table each test writes: the worker on its NPU, on another, or
absent. NPU 3's CPU affinity is CPU 0 and NPU 5's CPU 1 (the others: every CPU), so the
NPU a worker got shows in the masks read back from /proc. CPU 0 and CPU 1 stand for the
lowest two CPUs the tests may use (``FIRST``, ``SECOND``), as another machine may give them
other CPUs. Each test checks the NPU,
the rule the daemon says picked it, and every thread's mask, or the refusal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascendbind.values.cpulist import format_cpulist
from ascendbind.errors import Conflict

from .containers import FakeNpuHost, contained_worker, daemon_with_driver_major, npu_major
from .daemon_harness import DaemonProc, base_env, free_port, metric_value, wait_for
from .golden import run_plan
from .workers import cpus_allowed_of

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two NPUs need two CPUs to tell apart")

ROOT = Path(__file__).resolve().parent.parent
STANDIN = [str(ROOT / "tests" / "vllm_standin.py")]
MAJOR = npu_major()
# the two CPUs the NPUs of interest sit near: the lowest two this test may use (CPU 0 and CPU 1
# on most machines); with one CPU the module is skipped, and the names still resolve
FIRST, SECOND = (sorted(os.sched_getaffinity(0)) * 2)[:2]


def affinities(own: dict[int, int]) -> str:
    """The fixture npu-smi's per-NPU affinity: NPU n on CPU own[n], the others on every CPU."""
    every = format_cpulist(os.sched_getaffinity(0))
    return ";".join(str(own[n]) if n in own else every for n in range(8))


A2 = {"ASCENDBIND_FAKE_NPUS": "8", "ASCENDBIND_FAKE_NPU_AFFINITY": affinities({3: FIRST, 5: SECOND})}
A950 = {"ASCENDBIND_FAKE_NPUS": "8", "ASCENDBIND_FAKE_CHIP": "950PR", "ASCENDBIND_FAKE_PHY_IDS": "4,5,6,7,0,1,2,3",
        "ASCENDBIND_FAKE_NPU_AFFINITY": affinities({2: SECOND, 5: FIRST})}
CPU_OF = {3: FIRST, 5: SECOND, 2: SECOND}  # an A2's NPU 3 and 5, a 950's NPU 2 (and 5: FIRST)
DEVICE_PLUGIN = {"ASCEND_VISIBLE_DEVICES": "5", "ASCEND_RUNTIME_OPTIONS": ""}


class World:
    def __init__(self, directory: Path, fake: dict[str, str], **extra: str) -> None:
        self.dir = directory
        self.host = FakeNpuHost(str(directory / "host"), **fake)
        env = base_env(str(directory / "s.sock"), str(directory / "state"), free_port(),
                       ASCENDBIND_FIXTURE_HOST=self.host.dir, **extra)
        self.daemon = DaemonProc(str(directory), env, daemon_with_driver_major(str(directory), MAJOR)).start()
        self.daemon.wait_discovered()

    def held(self) -> dict[int, dict]:
        return {w["pid"]: w for w in self.daemon.client.workers()["workers"]}


@pytest.fixture(scope="module")
def a2(tmp_path_factory):
    world = World(tmp_path_factory.mktemp("a2"), A2)
    yield world
    world.daemon.stop()


@pytest.fixture(scope="module")
def a950(tmp_path_factory):
    # planned as an A2 (topo_affinity) on this small box; the 950's naming is what is tested
    world = World(tmp_path_factory.mktemp("a950"), A950, ASCENDBIND_DEVICE_TYPE="A2")
    yield world
    world.daemon.stop()


@pytest.fixture(autouse=True)
def fresh(request):
    yield
    for name in ("a2", "a950"):
        if name in request.fixturenames:
            world = request.getfixturevalue(name)
            assert world.daemon.alive(), world.daemon.log()
            world.daemon.client.release(all=True)
            world.host.table()


def plugin(world: World, tmp_path: Path, *, env: dict[str, str] | None = None, devices=(), allow=None):
    """The vLLM stand-in (it loads ascendbind's plugin as vLLM does), contained when ``devices``
    or ``allow`` is given, else on the bare host."""
    stderr = open(tmp_path / "standin.stderr", "w")
    env = {"ASCENDBIND_SOCKET": world.daemon.sock, "ASCENDBIND_PLUGIN_WAIT_SECONDS": "60", **(env or {})}
    return contained_worker(devices, env=env, allow=allow, major=MAJOR, program=STANDIN, stderr=stderr,
                            bare=not devices and allow is None)


def drive(worker, index: int) -> None:
    assert worker._ask(f"drive {index}") == "ok"
    assert worker._ask("join") == "done"


def assert_bound(world: World, pid: int, npu: int, rule: str, cpu_of=CPU_OF) -> dict:
    entry = world.held().get(pid)
    assert entry is not None, world.daemon.log()[-3000:]
    assert entry["npus"] == [npu] and entry["plan"]["targets"]["rule"] == rule, entry["plan"]["targets"]
    (plan,) = entry["plan"]["npus"].values()
    assert plan["pool"] == [cpu_of[npu]]
    masks = {cpus_allowed_of(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")} - {None}
    assert masks == {frozenset({cpu_of[npu]})}  # every thread, read back from the kernel
    return entry


def evidence(entry: dict) -> dict[str, list | None]:
    return {e["source"]: e["npus"] for e in entry["plan"]["targets"]["evidence"]}


# ------------------------------------------------------------ bare host

def test_bare_host_the_plugins_device_index_is_its_npu_and_the_table_agrees(a2, tmp_path):
    with plugin(a2, tmp_path) as w:
        a2.host.table((w.pid, 3))
        drive(w, 3)
        entry = assert_bound(a2, w.pid, 3, "device_index")
        assert evidence(entry)["process_table"] == [3]


def test_bare_host_a_table_that_puts_the_worker_elsewhere_refuses_it(a2, tmp_path):
    with plugin(a2, tmp_path) as w:
        a2.host.table((w.pid, 5))
        drive(w, 3)
        assert w.pid not in a2.held()
    warning = (tmp_path / "standin.stderr").read_text()
    assert "[npu_mismatch]" in warning and "process table puts pid" in warning and "on NPU 5" in warning


def test_bare_host_absent_from_the_table_the_index_decides(a2, tmp_path):
    with plugin(a2, tmp_path) as w:
        drive(w, 5)
        entry = assert_bound(a2, w.pid, 5, "device_index")
        assert evidence(entry)["process_table"] == []


def test_a_worker_whose_main_thread_pinned_itself_is_planned_from_its_cpuset(a2):
    # libgomp with OMP_PROC_BIND pins the calling thread before any binder runs
    with contained_worker(bare=True) as w:
        w.narrow_main({SECOND})
        answer = a2.daemon.client.bind(pid=w.pid, npu=3)
        assert answer["plan"]["allowed_cpus"] == sorted(os.sched_getaffinity(0))
        assert_bound(a2, w.pid, 3, "request")


# ------------------------------------------------------------ docker

def test_docker_with_ascend_visible_devices_device_0_is_the_physical_npu(a2, tmp_path):
    # the Ascend docker runtime: /dev/davinci3 with the host's major:minor, allowed in the devices cgroup
    with plugin(a2, tmp_path, env={"ASCEND_VISIBLE_DEVICES": "3"}, devices=[("davinci3", 3)], allow=[3]) as w:
        drive(w, 0)
        entry = assert_bound(a2, w.pid, 3, "device_index")
        assert evidence(entry)["device_nodes"] == [3] and evidence(entry)["devices_cgroup"] == [3]
        assert evidence(entry)["visible_devices"] == [3]


def test_bare_docker_run_with_a_device_flag_is_bound_by_its_devices_alone(a2):
    # `docker run --device /dev/davinci3`: no variable at all, nothing in the request
    with contained_worker([("davinci3", 3)], allow=[3], major=MAJOR) as w:
        a2.daemon.client.bind(pid=w.pid)
        entry = assert_bound(a2, w.pid, 3, "container_devices")
        assert any(f"/dev/davinci3 ({MAJOR}:3)" in e["detail"] for e in entry["plan"]["targets"]["evidence"])
        assert evidence(entry)["visible_devices"] is None


# ------------------------------------------------------------ Kubernetes, Ascend device plugin

def test_device_plugin_pod_asking_for_its_local_npu_0_is_refused_naming_both(a2):
    rejected = metric_value(a2.daemon.metrics_text(), "ascendbind_bind_requests_total", outcome="rejected") or 0
    with contained_worker([("davinci5", 5)], env=DEVICE_PLUGIN, allow=[5], major=MAJOR) as w:
        with pytest.raises(Conflict) as exc:
            a2.daemon.client.bind(pid=w.pid, npu=0)
        assert exc.value.code == "npu_mismatch" and exc.value.status == 409
        assert "names NPU 0" in str(exc.value) and "only NPU 5" in str(exc.value)
        lines = {e["source"]: e for e in exc.value.payload["evidence"]}
        assert lines["device_nodes"]["npus"] == [5]
        assert w.pid not in a2.held()
    # a request the evidence contradicts is a bad request, not a failure of the host
    after = metric_value(a2.daemon.metrics_text(), "ascendbind_bind_requests_total", outcome="rejected")
    assert after == rejected + 1


def test_device_plugin_pod_the_plugins_device_0_is_npu_5(a2, tmp_path):
    with plugin(a2, tmp_path, env=DEVICE_PLUGIN, devices=[("davinci5", 5)], allow=[5]) as w:
        drive(w, 0)
        assert_bound(a2, w.pid, 5, "device_index")
    assert (tmp_path / "standin.stderr").read_text() == ""


def test_device_plugin_pod_started_by_ascendbind_run_without_an_npu(a2):
    # deploy/kubernetes/examples/vllm-worker.yaml's command, with our worker in vLLM's place
    from .deploy_tools import K8S, yaml_docs
    from .workers import _CHILD

    (pod,) = yaml_docs(K8S / "examples" / "vllm-worker.yaml")[0]["spec"]["containers"]
    assert pod["command"][0] == "ascendbind"
    program = ["-m", "ascendbind.cli", *pod["command"][1:], sys.executable, "-c", _CHILD, "worker_0"]
    env = {**DEVICE_PLUGIN, "ASCENDBIND_SOCKET": a2.daemon.sock, "PYTHONPATH": str(ROOT)}
    with contained_worker([("davinci5", 5)], env=env, allow=[5], major=MAJOR, program=program) as runner:
        assert wait_for(lambda: len(a2.held()) == 1, 30), a2.daemon.log()[-3000:]
        (pid,) = a2.held()
        assert pid != runner.pid and os.listdir(f"/proc/{pid}/root/dev") == ["davinci5"]
        assert_bound(a2, pid, 5, "container_devices")


def test_device_plugin_pod_a_table_putting_it_elsewhere_is_outweighed_by_its_devices(a2, tmp_path):
    with plugin(a2, tmp_path, env=DEVICE_PLUGIN, devices=[("davinci5", 5)], allow=[5]) as w:
        a2.host.table((w.pid, 3))  # a stale table, or a pid of another namespace
        drive(w, 0)
        entry = assert_bound(a2, w.pid, 5, "device_index")
        assert any("on NPU 3" in x and "ignored" in x for x in entry["plan"]["targets"]["warnings"])


def test_device_plugin_pod_listed_on_its_npu_is_bound_by_the_table(a2):
    with contained_worker([("davinci5", 5)], env=DEVICE_PLUGIN, allow=[5], major=MAJOR) as w:
        a2.host.table((w.pid, 5))
        a2.daemon.client.bind(pid=w.pid)
        assert_bound(a2, w.pid, 5, "process_table")


# ------------------------------------------------------------ HAMi vNPU

def test_hami_vnpu_with_an_empty_process_table_binds_its_parent_npu(a2, tmp_path):
    # a vNPU cut from physical NPU 5: udevid 100 + 16 x 5 + 0; HAMi sets the parent's id
    env = {"ASCEND_VISIBLE_DEVICES": "5", "ASCEND_VNPU_SPECS": "vir05_1c_16g"}
    with plugin(a2, tmp_path, env=env, devices=[("vdavinci180", 180)], allow=[180]) as w:
        drive(w, 0)
        entry = assert_bound(a2, w.pid, 5, "device_index")
        assert evidence(entry)["device_nodes"] == [5] and evidence(entry)["process_table"] == []


# ------------------------------------------------------------ Ascend 950: names are logic ids, minors physical

def test_ascend950_pod_is_bound_by_its_nodes_minor_not_its_name(a950, tmp_path):
    # the device plugin gave logic NPU 2, physical 6: /dev/davinci2 is 236:6
    env = {"ASCEND_VISIBLE_DEVICES": "2"}
    with plugin(a950, tmp_path, env=env, devices=[("davinci2", 6)], allow=[6]) as w:
        drive(w, 0)
        entry = assert_bound(a950, w.pid, 2, "device_index")
        assert evidence(entry)["device_nodes"] == [2]


def test_ascend950_bare_host_device_index_is_the_logic_id(a950, tmp_path):
    with plugin(a950, tmp_path) as w:
        drive(w, 5)
        assert_bound(a950, w.pid, 5, "device_index", cpu_of={5: FIRST})


# ------------------------------------------------------------ status, explain, and a snapshot of a case

def test_status_and_explain_show_the_rule_and_the_evidence(a2, tmp_path):
    with contained_worker([("davinci3", 3)], env={"ASCEND_VISIBLE_DEVICES": "3"}, allow=[3], major=MAJOR) as w:
        a2.daemon.client.bind(pid=w.pid, device_index=0)
        env = {**os.environ, "ASCENDBIND_SOCKET": a2.daemon.sock, "ASCENDBIND_CONFIG": ""}
        status = subprocess.run([sys.executable, "-m", "ascendbind", "status"], env=env, capture_output=True,
                                text=True, timeout=60, cwd=ROOT)
        assert status.returncode == 0, status.stderr
        assert f"{w.pid}: NPU 3 by rule device_index: device index 0 of pid {w.pid}'s runtime is NPU 3" in status.stdout
        explain = subprocess.run([sys.executable, "-m", "ascendbind", "status", "--pid", str(w.pid), "--explain"],
                                 env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert explain.returncode == 0, explain.stderr
        assert "targets: NPU 3 by rule device_index" in explain.stdout
        assert f"/dev/davinci3 ({MAJOR}:3) -> NPU 3" in explain.stdout and "ASCEND_VISIBLE_DEVICES=3" in explain.stdout


def test_a_snapshot_of_a_device_plugin_pod_replays_its_decision(a2, tmp_path):
    snap = tmp_path / "snap"
    with contained_worker([("davinci5", 5)], env=DEVICE_PLUGIN, allow=[5], major=MAJOR) as w:
        env = {**a2.daemon.env, "ASCENDBIND_CONFIG": ""}
        argv = daemon_with_driver_major(str(tmp_path), MAJOR)[:-1] + ["snapshot", str(snap), "--pid", str(w.pid)]
        rec = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert rec.returncode == 0, rec.stderr
    assert (snap / "proc" / str(w.pid) / "root" / "dev").read_text() == f"davinci5 {MAJOR}:5\n"
    assert json.loads((snap / "meta.json").read_text())["env"] == DEVICE_PLUGIN
    code, plan, err = run_plan(str(snap), ["--device-index", "0", "--small-pool", "share"])
    assert code == 0, err
    assert list(plan["npus"]) == ["5"] and plan["targets"]["rule"] == "device_index"
    code, plan, err = run_plan(str(snap), ["--npu", "0"])
    assert code == 9 and "only NPU 5" in err



# ------------------------------------------------------------ one rule: the runtime's devices, step by step

RENAMED = [(f"davinci{i}", 3 + i) for i in range(5)]  # a container of host NPUs 3..7, named by its own numbering
THREE_TO_SEVEN = [3, 4, 5, 6, 7]


def test_renamed_nodes_the_runtimes_device_0_is_npu_5(a2, tmp_path):
    # the name says nothing, the minor does: ASCEND_RT_VISIBLE_DEVICES=2 is the third of 3..7
    env = {"ASCEND_RT_VISIBLE_DEVICES": "2"}
    with plugin(a2, tmp_path, env=env, devices=RENAMED, allow=THREE_TO_SEVEN) as w:
        drive(w, 0)
        entry = assert_bound(a2, w.pid, 5, "device_index")
        assert evidence(entry)["device_nodes"] == THREE_TO_SEVEN and evidence(entry)["rt_visible_devices"] == [5]
        assert "/dev/davinci2 (%d:5) -> NPU 5" % MAJOR in next(
            e["detail"] for e in entry["plan"]["targets"]["evidence"] if e["source"] == "device_nodes")


def test_renamed_nodes_explained_step_by_step(a2, tmp_path):
    env = {"ASCEND_RT_VISIBLE_DEVICES": "2"}
    with contained_worker(RENAMED, env=env, allow=THREE_TO_SEVEN, major=MAJOR) as w:
        argv = daemon_with_driver_major(str(tmp_path), MAJOR)[:-1] + ["plan", "--pid", str(w.pid), "--device-index",
                                                                     "0", "--small-pool", "share", "--explain"]
        run = subprocess.run(argv, env={**a2.daemon.env, "ASCENDBIND_CONFIG": ""}, capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "targets: NPU 5 by rule device_index" in run.stdout
    assert "runtime: it can open NPU 3,4,5,6,7" in run.stdout
    assert "runtime: after ASCEND_RT_VISIBLE_DEVICES=2: device 0 = NPU 5" in run.stdout
    assert "runtime: device index 0 -> NPU 5" in run.stdout


def test_a_container_whose_devices_cannot_be_read_is_refused_not_given_the_hosts(a2, tmp_path):
    # without the driver's major (here: a planner that cannot read it) the container's nodes cannot be
    # told apart; the host's NPU 2 would be a guess, so the position is refused
    env = {"ASCEND_RT_VISIBLE_DEVICES": "2"}
    with contained_worker(RENAMED, env=env, allow=THREE_TO_SEVEN, major=MAJOR) as w:
        run = subprocess.run([sys.executable, "-m", "ascendbind", "plan", "--pid", str(w.pid), "--device-index", "0",
                              "--explain"], env={**a2.daemon.env, "ASCENDBIND_CONFIG": ""}, capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 9, (run.stdout, run.stderr)
    assert "[npu_mismatch]" in run.stdout + run.stderr
    assert "device index 0 cannot be resolved" in run.stderr and "could not be read" in run.stderr
    assert "NPU 2" not in run.stderr


def test_vllm_ascend_bare_host_the_device_index_among_rt_visible_devices(a2, tmp_path):
    # rank 1 of a server started with ASCEND_RT_VISIBLE_DEVICES=4,5,6,7 drives device 1: NPU 5
    with plugin(a2, tmp_path, env={"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}) as w:
        a2.host.table((w.pid, 5))
        drive(w, 1)
        assert_bound(a2, w.pid, 5, "device_index")


def test_vllm_ascend_container_of_npus_3_to_7_rt_visible_2_is_npu_5(a2, tmp_path):
    # the nodes keep the host's names here; the answer is the same as when they are renamed
    nodes = [(f"davinci{n}", n) for n in THREE_TO_SEVEN]
    with plugin(a2, tmp_path, env={"ASCEND_RT_VISIBLE_DEVICES": "2"}, devices=nodes, allow=THREE_TO_SEVEN) as w:
        drive(w, 0)
        assert_bound(a2, w.pid, 5, "device_index")


@pytest.mark.parametrize("minors", [list(range(8)), [4, 5, 6, 7]], ids=["every-npu", "npus-4-to-7"])
def test_mindie_motor_physical_visible_devices_and_logical_rt_visible_devices(a2, minors):
    # Motor: ASCEND_VISIBLE_DEVICES=4,5,6,7 (physical), ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 (positions among them)
    env = {"ASCEND_VISIBLE_DEVICES": "4,5,6,7", "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}
    with contained_worker([(f"davinci{n}", n) for n in minors], env=env, allow=minors, major=MAJOR) as w:
        a2.daemon.client.bind(pid=w.pid, device_index=1)
        entry = assert_bound(a2, w.pid, 5, "device_index")
        assert evidence(entry)["rt_visible_devices"] == [4, 5, 6, 7]


def test_a_variable_naming_a_device_the_container_cannot_open_is_refused(a2):
    with contained_worker(RENAMED, env={"ASCEND_VISIBLE_DEVICES": "1"}, allow=THREE_TO_SEVEN, major=MAJOR) as w:
        before = {cpus_allowed_of(w.pid, int(t)) for t in os.listdir(f"/proc/{w.pid}/task")}
        with pytest.raises(Conflict) as exc:
            a2.daemon.client.bind(pid=w.pid, device_index=0)
        assert exc.value.code == "npu_mismatch" and exc.value.status == 409
        assert "ASCEND_VISIBLE_DEVICES=1" in str(exc.value) and "cannot open" in str(exc.value)
        assert "NPU 3,4,5,6,7" in str(exc.value)
        assert w.pid not in a2.held()
        assert {cpus_allowed_of(w.pid, int(t)) for t in os.listdir(f"/proc/{w.pid}/task")} == before


def test_a_device_index_past_the_containers_devices_is_refused(a2):
    with contained_worker(RENAMED, env={"ASCEND_RT_VISIBLE_DEVICES": "4,3"}, allow=THREE_TO_SEVEN, major=MAJOR) as w:
        with pytest.raises(Conflict) as exc:
            a2.daemon.client.bind(pid=w.pid, device_index=2)
        assert exc.value.code == "npu_mismatch" and "sees 2 device(s): NPU 7,6" in str(exc.value)
        assert "device 0 = NPU 7, device 1 = NPU 6" in str(exc.value)
        assert w.pid not in a2.held()


# ------------------------------------------------------------ stray contexts: listed on its NPU and on NPU 0

def test_a_stray_context_on_npu_0_with_visible_devices_binds_npu_3_only(a2):
    with contained_worker(env={"ASCEND_VISIBLE_DEVICES": "3"}, bare=True) as w:
        a2.host.table((w.pid, 3), (w.pid, 0))
        answer = a2.daemon.client.bind(pid=w.pid)
        assert answer["npus"] == [3]
        entry = assert_bound(a2, w.pid, 3, "process_table")
        assert list(entry["plan"]["npus"]) == ["3"]
        assert any(f"pid {w.pid} on NPU 0" in x for x in answer["warnings"]), answer["warnings"]
    assert wait_for(lambda: "target npu warning" in a2.daemon.log() and f"pid {w.pid} on NPU 0" in a2.daemon.log(),
                    10), a2.daemon.log()[-3000:]


def test_a_stray_context_in_a_container_of_npu_3_binds_npu_3_only(a2):
    with contained_worker([("davinci0", 3)], allow=[3], major=MAJOR) as w:
        a2.host.table((w.pid, 3), (w.pid, 0))
        answer = a2.daemon.client.bind(pid=w.pid)
        assert_bound(a2, w.pid, 3, "process_table")
        assert any("NPU 0" in x for x in answer["warnings"]), answer["warnings"]


def test_a_stray_context_without_evidence_is_refused_naming_both(a2):
    from ascendbind.errors import PlanImpossible

    with contained_worker(bare=True) as w:
        a2.host.table((w.pid, 3), (w.pid, 0))
        before = {cpus_allowed_of(w.pid, int(t)) for t in os.listdir(f"/proc/{w.pid}/task")}
        with pytest.raises(PlanImpossible) as exc:
            a2.daemon.client.bind(pid=w.pid)
        assert exc.value.code == "stray_context" and exc.value.status == 422
        assert "NPU 0 and NPU 3" in str(exc.value)
        assert w.pid not in a2.held()
        assert {cpus_allowed_of(w.pid, int(t)) for t in os.listdir(f"/proc/{w.pid}/task")} == before
