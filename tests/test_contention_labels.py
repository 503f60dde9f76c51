"""The contention series' labels come from the host, and their number from its NPUs, for real.

* Pod labels: a real kubelet-shaped cgroup at the top of a real hierarchy names its pod
  (through the kubelet's log directory, here a temporary one bind-mounted on the daemon's
  ``/var/log`` in a mount namespace of its own); a real process of uid 1234 that makes the
  same pod's cgroups below a cgroup delegated to it (as systemd's ``Delegate=yes`` does:
  the directory and its ``cgroup.procs`` chowned to the user) and moves itself there is
  bound and named by nothing.
* Series: workers bound with every NPU set of a 4-NPU host keep at most one series per
  NPU, role and family, and a series leaves with the last worker that fed it.

Every cgroup made here is removed, leaf first, once its processes have exited.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ascendbind.values.cpulist import format_cpulist
from tests.builders import write_once
from tests.containers import with_bind_mount
from tests.cpuset_cgroups import kubepods_lock
from tests.daemon_harness import DaemonProc, base_env, free_port, running_daemon, wait_for
from tests.workers import PipeChild, start_worker

UID = "7c1f0a2e-4b5d-4e6f-8a9b-0c1d2e3f4a5b"
CID = "5e" * 32
ATTACKER = 1234
ROLE_FAMILIES = ("ascendbind_role_cpu_seconds_total", "ascendbind_role_run_delay_seconds_total",
                 "ascendbind_role_involuntary_switches_total")
FOREIGN = ("ascendbind_pool_foreign_cpu_seconds_total", "ascendbind_pool_foreign_interrupts_total")


def _hierarchy() -> str | None:
    """A cgroup hierarchy whose root this test may write: v1's cpu controller (no set-up a
    new cgroup must have before it takes a task, unlike cpuset), else the v2 unified root."""
    for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(root, "cgroup.procs")) and os.access(root, os.W_OK):
            return root
    return None


ROOT = _hierarchy()
pytestmark = pytest.mark.skipif(ROOT is None or os.geteuid() != 0,
                                reason="needs root and a writable cgroup hierarchy")


@contextlib.contextmanager
def _made(*paths: str) -> Iterator[None]:
    """Each of ``paths`` made (parents first) unless it exists; the ones made here removed
    afterwards, deepest first (their processes must have exited by then)."""
    made: list[str] = []
    try:
        for path in paths:
            if not os.path.isdir(path):
                os.mkdir(path)
                made.append(path)
        yield
    finally:
        for path in reversed(made):
            os.rmdir(path)


# uid 1234 in its delegated cgroup: makes the tree given below it, moves itself into the
# leaf, says so, and waits for its stdin to close
_ATTACKER = r"""
import os, sys
leaf = os.path.join(sys.argv[1], *sys.argv[2].split("/"))
sys.stdin.readline()
os.makedirs(leaf)
with open(os.path.join(leaf, "cgroup.procs"), "w") as fh:
    fh.write(str(os.getpid()))
print("moved", flush=True)
sys.stdin.read()
"""


def _pod_logs(directory: str, namespace: str, pod: str, container: str) -> str:
    """A kubelet log directory for one container: pods/<ns>_<pod>_<uid>/<container>/0.log and
    its link containers/<pod>_<ns>_<container>-<id>.log (only names are read)."""
    logs = os.path.join(directory, "log")
    target = os.path.join("/var/log/pods", f"{namespace}_{pod}_{UID}", container, "0.log")
    os.makedirs(os.path.join(logs, "pods", f"{namespace}_{pod}_{UID}", container))
    os.makedirs(os.path.join(logs, "containers"))
    open(os.path.join(logs, "pods", f"{namespace}_{pod}_{UID}", container, "0.log"), "w").close()
    os.symlink(target, os.path.join(logs, "containers", f"{pod}_{namespace}_{container}-{CID}.log"))
    for d in (directory, logs):
        os.chmod(d, 0o755)
    return logs


def _info(text: str, pid: int) -> tuple[str, str, str] | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "ascendbind_worker_info" and s.labels["pid"] == str(pid):
                return s.labels["namespace"], s.labels["pod_name"], s.labels["container_name"]
    return None


@pytest.mark.parametrize("layout", [f"pod{UID}/{CID}", f"kubepods/burstable/pod{UID}/{CID}"])
def test_pod_names_come_from_the_kubelets_cgroup_never_from_a_delegated_one(tmp_path, layout):
    logs = _pod_logs(str(tmp_path), "infer", "vllm-0", "engine")
    # both workers on the one NPU of the fixture npu-smi
    env = base_env(str(tmp_path / "s.sock"), str(tmp_path / "state"), free_port(), ASCENDBIND_ALLOW_SHARED_NPU="true")
    argv = with_bind_mount(logs, "/var/log", [sys.executable, "-m", "ascendbind.cli", "serve"])
    test_top = os.path.join(ROOT, f"ascendbind-test-{os.getpid()}")
    delegated = os.path.join(test_top, f"user@{ATTACKER}.service")
    kube = [os.path.join(ROOT, "kubepods"), os.path.join(ROOT, "kubepods", "burstable"),
            os.path.join(ROOT, "kubepods", "burstable", f"pod{UID}"),
            os.path.join(ROOT, "kubepods", "burstable", f"pod{UID}", CID)]
    with kubepods_lock(), _made(*kube, test_top, delegated):
        # systemd's Delegate=yes: the cgroup and the files that let its user manage it are the user's
        for name in ("", "cgroup.procs", "tasks", "cgroup.subtree_control", "cgroup.threads"):
            if os.path.exists(os.path.join(delegated, name)):
                os.chown(os.path.join(delegated, name), ATTACKER, ATTACKER)
        d = DaemonProc(str(tmp_path), env, argv).start()
        attacker = None
        try:
            with start_worker(plain=1, acl=1, release=1) as victim:
                write_once(os.path.join(kube[-1], "cgroup.procs"), str(victim.pid))  # as the runtime does
                attacker = PipeChild(subprocess.Popen(
                    ["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups",
                     "/usr/bin/python3", "-c", _ATTACKER, delegated, layout],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                write_once(os.path.join(delegated, "cgroup.procs"), str(attacker.pid))  # where systemd starts it
                assert attacker._ask("go") == "moved"
                with open(f"/proc/{attacker.pid}/cgroup") as fh:
                    assert f"/{layout}\n" in fh.read()  # it really is in the pod-looking cgroup it made
                for pid in (victim.pid, attacker.pid):
                    status, body = d.curl("POST", "/v1/bind", {"pid": pid, "npu": 0})
                    assert status == 200, body
                text = d.metrics_text()
                assert _info(text, victim.pid) == ("infer", "vllm-0", "engine"), text
                assert _info(text, attacker.pid) == ("", "", ""), text
                pods = {w["pid"]: w["contention"]["pod"] for w in d.client.workers()["workers"]}
                assert pods[attacker.pid] == {"namespace": "", "pod_name": "", "container_name": ""}
                assert pods[victim.pid] == {"namespace": "infer", "pod_name": "vllm-0", "container_name": "engine"}
        finally:
            if attacker is not None:
                attacker.close()
                parts = layout.split("/")
                for i in range(len(parts), 0, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(os.path.join(delegated, *parts[:i]))
            d.stop()


def _series(text: str) -> dict[str, dict[tuple, float]]:
    """Per family of the role and foreign series, labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple, float]] = {name: {} for name in (*ROLE_FAMILIES, *FOREIGN)}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


# four NPUs on two CPUs: NPU 0 near the first, NPU 1 near the second, NPUs 2 and 3 near both
# (they share them: one each)
_CPUS = sorted(os.sched_getaffinity(0))[:2]
FOUR = {"ASCENDBIND_FAKE_NPUS": "4", "ASCENDBIND_ALLOW_SHARED_NPU": "true",
        "ASCENDBIND_FAKE_NPU_AFFINITY": ";".join([str(_CPUS[0]), str(_CPUS[-1])] + [format_cpulist(_CPUS)] * 2)}


@pytest.mark.skipif(len(_CPUS) < 2, reason="four NPUs need two CPUs")
def test_series_are_bounded_by_the_npus_and_leave_with_their_last_worker(tmp_path):
    sets = [list(c) for k in range(1, 5) for c in itertools.combinations(range(4), k)]  # all 15
    with running_daemon(str(tmp_path), **FOUR) as d, contextlib.ExitStack() as stack:
        workers = [stack.enter_context(start_worker(plain=1, acl=1, release=1)) for _ in sets]
        # at the end all are killed at once, before each is reaped: fifteen exits overlap
        # instead of queueing one after another on a busy machine
        stack.callback(lambda: [w.proc.kill() for w in workers if w.proc.poll() is None])
        for w, npus in zip(workers, sets):
            status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": npus})
            assert status == 200, body
        d.client.workers()  # a look of every worker: every series there is
        workers[-1].burn("worker", 200)  # the four-NPU worker's main thread time lands on its NPUs
        assert wait_for(lambda: sum(v for k, v in _series(d.metrics_text())[ROLE_FAMILIES[0]].items()
                                    if ("role", "main") in k) >= 0.19, 10)
        series = _series(d.metrics_text())
        for name in ROLE_FAMILIES:
            # one per NPU and role (main, acl, release here), whatever NPU sets were asked for
            assert {dict(k)["npu"] for k in series[name]} == {"0", "1", "2", "3"}, series[name]
            assert len(series[name]) == 4 * 3, series[name]
        for name in FOREIGN:
            assert {dict(k)["npu"] for k in series[name]} == {"0", "1", "2", "3"}, series[name]
        info = [k for k in d.metrics_text().splitlines() if k.startswith("ascendbind_worker_info{")]
        assert len(info) == sum(map(len, sets))  # one per worker and NPU it drives

        # release the workers driving NPU 3 one by one: its series stay, never going back,
        # until the last goes, and the other NPUs' stay
        on3 = [w for w, npus in zip(workers, sets) if 3 in npus]
        before = _series(d.metrics_text())
        for i, w in enumerate(on3):
            assert d.curl("POST", "/v1/release", {"pid": w.pid})[0] == 200
            now = _series(d.metrics_text())
            for name in (*ROLE_FAMILIES, *FOREIGN):
                three = {k: v for k, v in now[name].items() if ("npu", "3") in k}
                if i < len(on3) - 1:
                    assert set(three) == {k for k in before[name] if ("npu", "3") in k}, (name, i)
                    assert all(v >= before[name][k] for k, v in three.items()), (name, i)
                else:
                    assert three == {}, (name, three)
                    assert {dict(k)["npu"] for k in now[name]} == {"0", "1", "2"}, now[name]
            before = now
