"""Whether bound workers get their CPUs: the per-role counters, the foreign load on a pool
and the worker info series, with real workers whose real threads burn, wait and exit,
checked against the kernel's own /proc readings; and the parsers behind them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ascendbind.discovery.gather.cpuusage import pod_names
from ascendbind.discovery.parse.kubelet import kubelet_place, parse_container_log, parse_pod_log_dir
from ascendbind.discovery.parse.schedstat import (parse_cpu_busy, parse_interrupt_counts, parse_interrupt_counts_by,
                                             parse_nonvoluntary, parse_schedstat, parse_stat_cpu)
from tests.daemon_harness import metric_value, running_daemon, wait_for
from tests.workers import cpus_allowed_of, start_worker

ROLES = ("main", "acl", "release")
FAMILIES = ("ascendbind_role_cpu_seconds_total", "ascendbind_role_run_delay_seconds_total",
            "ascendbind_role_involuntary_switches_total")


def _role(comm: str) -> str:
    return "acl" if comm.startswith("acl_thread") else "release" if comm.startswith("release_thread") else "main"


def _proc(pid: int) -> dict[str, list[float]]:
    """Per role, the sum over the worker's live threads of (cpu s, delay s, involuntary), read now."""
    out = {r: [0.0, 0.0, 0] for r in ROLES}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as fh:
                comm = fh.read().strip()
            with open(f"{base}/schedstat") as fh:
                cpu, delay = (int(x) for x in fh.read().split()[:2])
            with open(f"{base}/status") as fh:
                nonvol = int(fh.read().rpartition("nonvoluntary_ctxt_switches:")[2].split()[0])
        except (OSError, ValueError):
            continue
        r = out[_role(comm)]
        r[0] += cpu / 1e9
        r[1] += delay / 1e9
        r[2] += nonvol
    return out


def _exported(text: str, npu: str = "0") -> dict[str, list[float]]:
    return {r: [metric_value(text, f, npu=npu, role=r) for f in FAMILIES] for r in ROLES}


def _grows(before: dict, after: dict) -> None:
    for r in ROLES:
        for i, f in enumerate(FAMILIES):
            assert after[r][i] is not None and after[r][i] >= before[r][i], (r, f, before[r][i], after[r][i])


def test_role_counters_agree_with_proc_grow_across_a_thread_exit_and_leave_with_the_release(tmp_path):
    with running_daemon(str(tmp_path)) as d, start_worker(plain=1, acl=1, release=1) as w:
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, body
        acl = set(d.client.workers()["workers"][0]["plan"]["npus"]["0"]["acl"])
        first = _exported(d.metrics_text())  # the first look: the series exist, at 0
        assert all(v == [0, 0, 0] for v in first.values()), first

        # GET /v1/workers takes a look of its own; the scrape right after shows it or a later one
        p1a = _proc(w.pid)
        d.client.workers()
        m1 = _exported(d.metrics_text())
        p1b = _proc(w.pid)
        # two main threads contend for the main CPUs, two ACL threads burn after the loop pins them
        w.burn("worker", 300, 2)
        acl_tids = w.burn("acl_thread", 200, 2)
        assert wait_for(lambda: all(cpus_allowed_of(w.pid, t) == acl for t in acl_tids), 10), d.log()[-2000:]
        # a look younger than a second is reused; wait for one that sees the ACL threads as such
        assert wait_for(lambda: metric_value(d.metrics_text(), FAMILIES[0], npu="0", role="acl") >= 0.3, 10)
        p2a = _proc(w.pid)
        d.client.workers()
        m2 = _exported(d.metrics_text())
        p2b = _proc(w.pid)
        for r in ROLES:
            for i, f in enumerate(FAMILIES):
                grown = m2[r][i] - m1[r][i]
                low, high = p2a[r][i] - p1b[r][i], p2b[r][i] - p1a[r][i]
                # the scrape read each thread between the two /proc readings that bracket it
                assert low - 1e-6 <= grown <= high + 1e-6, (r, f, low, grown, high)
        assert m2["main"][0] - m1["main"][0] >= 0.55  # both burners' 300 ms
        assert m2["acl"][0] - m1["acl"][0] >= 0.35

        w.stop(acl_tids[0])  # a thread exits: what it had stays in the totals
        assert wait_for(lambda: d.client.workers()["workers"][0]["contention"]["roles"]["acl"]["threads"] == 2, 10)
        m3 = _exported(d.metrics_text())
        _grows(m2, m3)
        assert m3["acl"][0] >= m2["acl"][0]
        info = metric_value(d.metrics_text(), "ascendbind_worker_info", pid=str(w.pid), npu="0")
        assert info == 1

        assert d.curl("POST", "/v1/release", {"pid": w.pid})[0] == 200
        text = d.metrics_text()
        # released, the last worker on NPU 0: its series leave with it
        assert all(v == [None, None, None] for v in _exported(text).values()), _exported(text)
        assert metric_value(text, "ascendbind_pool_foreign_cpu_seconds_total", npu="0") is None
        assert metric_value(text, "ascendbind_worker_info", pid=str(w.pid)) is None


def test_workers_answer_shows_the_figures_per_role_since_the_bind(tmp_path):
    with running_daemon(str(tmp_path)) as d, start_worker(plain=1, acl=1, release=1) as w:
        assert d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})[0] == 200
        d.client.workers()  # the first look: from here on it counts
        w.burn("worker", 200)
        assert wait_for(lambda: d.client.workers()["workers"][0]["contention"]["roles"]["main"]["cpu_seconds"]
                        >= 0.19, 10)
        c = d.client.workers()["workers"][0]["contention"]
        assert set(c["roles"]) == {"main", "acl", "release"}
        assert c["roles"]["acl"]["threads_seen"] == 1 and c["roles"]["main"]["threads_seen"] >= 3
        assert set(c["foreign"]) == {"cpu_seconds", "interrupts"}
        assert c["pod"] == {"namespace": "", "pod_name": "", "container_name": ""}  # not in a pod
        out = subprocess.run([sys.executable, "-m", "ascendbind", "status", "--socket", d.sock],
                             capture_output=True, text=True, env=d.env, timeout=30)
        assert f"{w.pid}: run delay: main " in out.stdout, out.stdout + out.stderr
        assert f"{w.pid}: foreign on pool: " in out.stdout


_FOREIGN = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nend = time.thread_time() + 0.5\n" \
           "while time.thread_time() < end: pass\nprint(time.thread_time(), flush=True)\n"


def test_foreign_load_counts_another_process_on_the_pool_and_not_the_workers_own(tmp_path):
    with running_daemon(str(tmp_path)) as d, start_worker(plain=1, acl=1, release=1) as w:
        assert d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})[0] == 200
        npu = d.client.workers()["workers"][0]["plan"]["npus"]["0"]
        foreign0 = metric_value(d.metrics_text(), "ascendbind_pool_foreign_cpu_seconds_total", npu="0")
        assert foreign0 is not None
        # the worker's own burn on its main CPUs is not foreign
        w.burn("worker", 400)
        assert wait_for(lambda: d.client.workers()["workers"][0]["contention"]["roles"]["main"]["cpu_seconds"]
                        >= 0.39, 10)
        mine = metric_value(d.metrics_text(), "ascendbind_pool_foreign_cpu_seconds_total", npu="0")
        # another process burns 0.5 s on the pool's main CPU
        out = subprocess.run([sys.executable, "-c", _FOREIGN, str(npu["main"][0])], capture_output=True, text=True,
                             timeout=60, check=True)
        burned = float(out.stdout)
        assert wait_for(lambda: metric_value(d.metrics_text(), "ascendbind_pool_foreign_cpu_seconds_total",
                                             npu="0") - mine >= 0.8 * burned, 10)
        assert metric_value(d.metrics_text(), "ascendbind_pool_foreign_interrupts_total", npu="0") >= 0


# ------------------------------------------------------------------ parsers


def test_schedstat_and_status_parse_and_refuse_what_is_not_numbers():
    assert parse_schedstat("123 456 7\n") == (123, 456)
    assert parse_schedstat("x 1 2") is None and parse_schedstat("") is None
    status = "Name:\tpython3\nvoluntary_ctxt_switches:\t10\nnonvoluntary_ctxt_switches:\t42\n"
    assert parse_nonvoluntary(status) == 42
    assert parse_nonvoluntary("Name:\tx\n") is None
    assert parse_nonvoluntary("x\nnonvoluntary_ctxt_switches:\t-1\n") is None


def test_cpu_busy_sums_user_nice_system_irq_softirq_of_the_cpus_asked():
    text = ("cpu  100 1 50 9000 10 5 5 7 0 0\n"
            "cpu0 10 1 5 900 1 2 3 4 0 0\n"
            "cpu2 20 0 10 900 1 1 1 9 0 0\n"
            "intr 12345 1 2 3\n")
    assert parse_cpu_busy(text, [0, 1, 2]) == {0: 21, 2: 32}  # cpu1 offline: no line; steal left out


def test_interrupt_counts_follow_the_header_columns_and_skip_architecture_rows():
    text = ("           CPU0       CPU2       CPU3\n"
            "  24:         5          7          9   PCI-MSI 1 edge  eth0\n"
            "  25:         1          0          4   PCI-MSI 2 edge  sq_send_trigger_irq\n"
            " LOC:      1000       1000       1000   Local timer interrupts\n"
            "  26:       bad\n")
    assert parse_interrupt_counts(text, [2, 3]) == {24: 16, 25: 4}
    assert parse_interrupt_counts(text, [1]) == {}


UID = "1b2c3d4e-0000-4111-8222-123456789abc"
_UID = UID.replace("-", "_")
# a static pod without metadata.uid: the kubelet's MD5 of its manifest, 32 hex digits
STATIC = "0cf61a0b94befc6af8ecafeed1af66ce"


@pytest.mark.parametrize("path,expected", [
    # what the kubelet makes: its root at the top, a QoS class, the pod, the container under it
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_UID}.slice/cri-containerd-{'a' * 64}.scope",
     (UID, "a" * 64)),
    (f"/kubepods/besteffort/pod{UID}/{'b' * 64}", (UID, "b" * 64)),
    (f"/kubepods/pod{UID}", (UID, None)),
    (f"/kubepods.slice/kubepods-pod{_UID}.slice/crio-{'c' * 64}.scope", (UID, "c" * 64)),
    # static pods: the same places, the UID without dashes (cgroupfs, and the systemd driver)
    (f"/kubepods/pod{STATIC}/{'b' * 64}", (STATIC, "b" * 64)),
    (f"/kubepods/burstable/pod{STATIC.upper()}/{'b' * 64}", (STATIC, "b" * 64)),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{STATIC}.slice/cri-containerd-{'a' * 64}"
     ".scope", (STATIC, "a" * 64)),
    # neither form: a hex run one digit short or long, a UUID with a group missing
    (f"/kubepods/pod{STATIC[:-1]}/{'b' * 64}", (None, None)),
    (f"/kubepods/pod{STATIC}0/{'b' * 64}", (None, None)),
    (f"/kubepods/pod{UID[:-13]}/{'b' * 64}", (None, None)),
    # a cgroup the container made below its own: still that container of that pod
    (f"/kubepods/burstable/pod{UID}/{'b' * 64}/sub", (UID, "b" * 64)),
    # read from a cgroup namespace of its own (a DaemonSet's container on cgroup v2): the path
    # climbs to an ancestor of the reader's cgroup, root's, and goes on the kubelet's way
    (f"/../../kubepods-besteffort.slice/kubepods-besteffort-pod{_UID}.slice/cri-containerd-{'a' * 64}.scope",
     (UID, "a" * 64)),
    (f"/../../../kubepods-pod{_UID}.slice/cri-containerd-{'a' * 64}.scope", (UID, "a" * 64)),
    ("/user.slice/user-0.slice/session-1.scope", (None, None)),
    ("/system.slice/docker-" + "c" * 64 + ".scope", (None, None)),  # a container, but no pod
    # what a user can make in a delegated cgroup of theirs, or a container below its own
    (f"/user.slice/user-1234.slice/user@1234.service/app.slice/kubepods/pod{UID}/{'d' * 64}", (None, None)),
    (f"/user.slice/user-1234.slice/user@1234.service/pod{UID}/{'d' * 64}", (None, None)),
    (f"/../../user.slice/user-1234.slice/pod{UID}/{'d' * 64}", (None, None)),
    (f"/kubepods/burstable/x/pod{UID}/{'d' * 64}", (None, None)),  # the pod must be the first level below
    (f"/kubepods/burstable/pod{UID}/x/{'d' * 64}", (UID, None)),  # the container: directly under the pod
    (f"/kubepods/pod{UID}/x/pod{UID.replace('1b', '2b')}/{'d' * 64}", (UID, None)),  # the first pod wins
    (f"/kubepods.slice/kubepods-burstable-pod{_UID}.slice/x", (None, None)),  # a QoS slice out of place
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{_UID}.slice", (None, None)),
    (f"/kubepods/burstable.slice/pod{UID}", (None, None)),  # the drivers mixed
    (f"/kubepods/../kubepods/pod{UID}", (None, None)),
    (f"kubepods/pod{UID}", (None, None)),
])
def test_a_pod_is_read_only_from_where_the_kubelet_makes_it(path, expected):
    place = kubelet_place(path)
    assert (place.pod_uid, place.container_id) == expected


def test_log_names_follow_the_kubernetes_name_rules():
    cid = "d" * 64
    assert parse_container_log(f"vllm-0_infer_engine-{cid}.log") == ("vllm-0", "infer", "engine", cid)
    assert parse_container_log(f"vllm-0_infer_engine-{cid[:-1]}.log") is None
    assert parse_container_log("../etc_passwd_x-" + cid + ".log") is None
    assert parse_container_log(f"vllm-0_Infer_engine-{cid}.log") is None  # a namespace is lower case
    assert parse_pod_log_dir(f"infer_vllm-0_{UID}") == ("infer", "vllm-0", UID)
    assert parse_pod_log_dir(f"in fer_vllm-0_{UID}") is None
    assert parse_pod_log_dir(f"infer_vllm-0_{UID[:-1]}") is None
    # a static pod's directory: its name carries the node's, its UID has no dashes
    assert parse_pod_log_dir(f"default_pinned-node1_{STATIC}") == ("default", "pinned-node1", STATIC)
    assert parse_pod_log_dir(f"default_pinned-node1_{STATIC[:-1]}") is None
    assert parse_pod_log_dir(f"default_pinned-node1_{STATIC.upper()}") is None  # the kubelet writes lower case


def test_a_threads_cpu_is_read_past_a_command_with_spaces_and_parentheses():
    fields = ["S"] + ["0"] * 35 + ["7", "0"]
    assert parse_stat_cpu("123 (a) b (c)) " + " ".join(fields)) == 7
    assert parse_stat_cpu("123 (a) S 1 2") is None


def test_interrupt_counts_per_group_from_one_text():
    text = ("           CPU0       CPU2       CPU3\n"
            "  24:         5          7          9   PCI-MSI 1 edge  eth0\n"
            "  25:         1          0          4   PCI-MSI 2 edge  sq_send_trigger_irq\n")
    assert parse_interrupt_counts_by(text, {"a": [0], "b": [2, 3], "c": [1]}) == {
        "a": {24: 5, 25: 1}, "b": {24: 16, 25: 4}, "c": {}}


def test_pod_names_from_a_recorded_host(tmp_path):
    """A recorded /proc (the snapshot layout) and kubelet's log directory; nothing else read."""
    uid, cid = "1b2c3d4e-0000-4111-8222-123456789abc", "e" * 64
    (tmp_path / "proc" / "77").mkdir(parents=True)
    (tmp_path / "proc" / "77" / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n")
    logs = tmp_path / "log"
    (logs / "containers").mkdir(parents=True)
    (logs / "pods" / f"infer_vllm-0_{uid}" / "engine").mkdir(parents=True)
    proc, log = str(tmp_path / "proc"), str(logs)
    # without the container's link: the pod from its log directory, the one container in it
    assert pod_names(77, proc, log) == {"namespace": "infer", "pod_name": "vllm-0", "container_name": "engine"}
    (logs / "pods" / f"infer_vllm-0_{uid}" / "sidecar").mkdir()
    assert pod_names(77, proc, log) == {"namespace": "infer", "pod_name": "vllm-0", "container_name": ""}
    # the link names the container ID, its target the pod UID: both must agree with the cgroup
    link = logs / "containers" / f"vllm-0_infer_engine-{cid}.log"
    link.symlink_to(f"/var/log/pods/infer_vllm-0_{uid.replace('1b', '2b')}/engine/0.log")
    assert pod_names(77, proc, log) == {"namespace": "infer", "pod_name": "vllm-0", "container_name": ""}
    link.unlink()
    link.symlink_to(f"/var/log/pods/infer_vllm-0_{uid}/engine/0.log")
    assert pod_names(77, proc, log) == {"namespace": "infer", "pod_name": "vllm-0", "container_name": "engine"}
    # log directories anyone but root may write name nothing
    os.chmod(logs / "containers", 0o777)
    os.chmod(logs / "pods", 0o777)
    assert pod_names(77, proc, log) == {"namespace": "", "pod_name": "", "container_name": ""}
    os.chmod(logs / "containers", 0o755)
    os.chmod(logs / "pods", 0o755)
    assert pod_names(78, proc, log) == {"namespace": "", "pod_name": "", "container_name": ""}  # no such process


def test_a_static_pods_names_from_the_layout_a_real_kubelet_writes(tmp_path):
    """kubelet 1.20, cgroupfs driver: a static pod ``pinned`` on node ``node1`` runs as pod
    ``pinned-node1`` whose UID is 32 hex digits, in ``/kubepods/pod<uid>/<id>`` on every v1
    hierarchy and the unified one; its log directory and container link carry the same UID."""
    cid = "f" * 64
    (tmp_path / "proc" / "81").mkdir(parents=True)
    (tmp_path / "proc" / "81" / "cgroup").write_text(
        "".join(f"{i}:{c}:/kubepods/pod{STATIC}/{cid}\n" for i, c in ((9, "memory"), (3, "cpuset"), (2, "cpu,cpuacct")))
        + f"0::/kubepods/pod{STATIC}/{cid}\n")
    logs = tmp_path / "log"
    (logs / "containers").mkdir(parents=True)
    (logs / "pods" / f"default_pinned-node1_{STATIC}" / "work").mkdir(parents=True)
    (logs / "containers" / f"pinned-node1_default_work-{cid}.log").symlink_to(
        f"/var/log/pods/default_pinned-node1_{STATIC}/work/0.log")
    proc, log = str(tmp_path / "proc"), str(logs)
    assert pod_names(81, proc, log) == {"namespace": "default", "pod_name": "pinned-node1", "container_name": "work"}


def test_a_thread_of_a_worker_of_several_npus_counts_to_the_npu_whose_cpus_it_is_on():
    from types import SimpleNamespace

    from ascendbind.daemon.api.contention import _View
    from ascendbind.values.model import NpuPlan

    plans = (NpuPlan(3, (8, 9, 10, 11, 12), (8, 9), (10,), (11,), (12,), (1,)),
             NpuPlan(1, (0, 1, 2, 3, 4), (0, 1), (2,), (3,), (4,), (0,)))
    binding = SimpleNamespace(pid=5, start_time=7, irqs=(), plan=SimpleNamespace(npus=plans, uvb_tids=(), irqs=None))
    v = _View(SimpleNamespace(binding=binding, threads={}))
    assert v.npus == (1, 3)
    assert [v.npu_of("main", c) for c in (2, 10)] == [1, 3]
    assert [v.npu_of("acl", c) for c in (3, 11)] == [1, 3]
    # an ACL thread on the other NPU's main CPU: that NPU's pool holds it
    assert v.npu_of("acl", 10) == 3
    # off every pool, its CPU unknown, or a UVB poll thread (the UVB pool is no NPU's): the lowest NPU
    assert v.npu_of("main", 30) == v.npu_of("main", None) == v.npu_of("uvb", 10) == 1
    assert v.pools == {1: frozenset({2, 3, 4}), 3: frozenset({10, 11, 12})}
