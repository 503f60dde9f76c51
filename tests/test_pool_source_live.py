"""pool_source on this host: a real worker in a pod-shaped cpuset cgroup, bound by a real daemon.

The worker lives in ``/kubepods/pod<uid>/<id>`` at the top of the hierarchy (where only the
kubelet can make it) limited to the host's last CPU, the shape kubelet's cgroupfs driver
gives a Guaranteed pod's container, on
whichever hierarchy this machine has (tests/cpuset_cgroups.py): cgroup v1's cpuset one
(``/sys/fs/cgroup/cpuset``) or cgroup v2's unified one; kubelet's checkpoint is a file in a
temporary ``kubelet_root``. The daemon runs the fixture npu-smi with two NPUs
whose affinity is every CPU: the placement rules share the worker's one CPU
between NPU 0 and the hidden NPU 1 and leave NPU 0 nothing, while the worker's
own cpuset is a pool (roles sharing it, ``small_pool = share``). Every thread's
``Cpus_allowed_list`` is read back from ``/proc``. The cgroups are removed and
the workers reaped whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from tests import cpuset_cgroups
from tests.daemon_harness import kubelet_node
from tests.workers import cpus_allowed_of, start_worker

CPUS = sorted(os.sched_getaffinity(0))
UID = "5e6f7a8b-9c0d-4e1f-a2b3-c4d5e6f7a8b9"
CONTAINER = "e1" * 32

# in CI (CI set) a machine without either is a failure, not a skip
pytestmark = [
    pytest.mark.skipif(len(CPUS) < 2 and not os.environ.get("CI"), reason="a cpuset narrower than the host needs 2 CPUs"),
    pytest.mark.skipif(cpuset_cgroups.why_not() is not None and not os.environ.get("CI"),
                       reason=str(cpuset_cgroups.why_not())),
    pytest.mark.usefixtures("which_hierarchy"),
]


def pod_cgroup(cpus: str):
    """A cpuset tree shaped like a pod's container, limited to ``cpus``; removed afterwards."""
    return cpuset_cgroups.cpuset_tree(["kubepods", f"pod{UID}", CONTAINER], cpus, at_root=True)


@contextlib.contextmanager
def pod_worker(cgroup: str):
    with start_worker(plain=2, acl=1, release=1) as w:
        cpuset_cgroups.move(cgroup, w.pid)  # every thread moves with the process
        yield w


def masks(w) -> dict[int, frozenset[int] | None]:
    return {tid: cpus_allowed_of(w.pid, tid) for tid in w.threads()}


@pytest.fixture(scope="module")
def node():
    """(daemon, kubelet_root) on the fixture two-NPU host."""
    with kubelet_node("ascendbind-pool-") as pair:
        yield pair


def checkpoint(kubelet: str, cpus: str) -> None:
    others = ",".join(str(c) for c in CPUS if str(c) != cpus)
    with open(os.path.join(kubelet, "cpu_manager_state"), "w") as fh:
        json.dump({"policyName": "static", "defaultCpuSet": others, "entries": {UID: {"vllm": cpus}},
                   "checksum": 1}, fh)


def test_auto_binds_a_pod_worker_to_its_own_cpu_with_kubelets_checkpoint(node):
    d, kubelet = node
    own = str(CPUS[-1])
    checkpoint(kubelet, own)
    with pod_cgroup(own) as cg, pod_worker(cg) as w:
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0, "pool_source": "slice"})
        assert status == 422, body  # the placement rules: the hidden NPU 1 takes the one CPU
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, (body, d.log()[-2000:])
        plan = body["plan"]
        assert plan["npus"]["0"]["pool"] == [CPUS[-1]]
        assert plan["pool_source"]["requested"] == "auto" and "container 'vllm'" in plan["pool_source"]["evidence"]
        assert set(masks(w).values()) == {frozenset({CPUS[-1]})}
        d.curl("POST", "/v1/release", {"pid": w.pid})


def test_auto_without_a_matching_entry_keeps_the_placement_rules(node):
    d, kubelet = node
    own = str(CPUS[-1])
    checkpoint(kubelet, str(CPUS[0]))  # the pod's entry is another CPU: stale, not proof
    with pod_cgroup(own) as cg, pod_worker(cg) as w:
        before = masks(w)
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 422 and body["error"] == "pool_too_small", body
        assert masks(w) == before


def test_cpuset_binds_without_a_checkpoint(node):
    d, kubelet = node
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(kubelet, "cpu_manager_state"))
    own = str(CPUS[-1])
    with pod_cgroup(own) as cg, pod_worker(cg) as w:
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0, "pool_source": "cpuset"})
        assert status == 200, body
        assert body["plan"]["pool_source"]["requested"] == "cpuset"
        assert set(masks(w).values()) == {frozenset({CPUS[-1]})}
        status, listing = d.curl("GET", "/v1/workers")
        assert [x["pool_source"] for x in listing["workers"]] == ["cpuset"]
        d.curl("POST", "/v1/release", {"pid": w.pid})


def test_a_snapshot_records_the_checkpoint_and_plans_as_the_host_does(node, tmp_path, monkeypatch):
    from ascendbind.values.config import Config
    from ascendbind.discovery.gather.snapshot import record_snapshot
    from tests.daemon_harness import FIXTURE_BIN
    from tests.golden import run_plan

    _d, kubelet = node
    own = str(CPUS[-1])
    checkpoint(kubelet, own)
    monkeypatch.setenv("ASCENDBIND_FAKE_NPUS", "2")
    with pod_cgroup(own) as cg, pod_worker(cg) as w:
        files = record_snapshot(str(tmp_path / "snap"), w.pid, Config(npu_smi=str(FIXTURE_BIN / "npu-smi"),
                                                                     kubelet_root=kubelet))
    assert "var/lib/kubelet/cpu_manager_state" in files
    assert any(f.endswith(f"/{cpuset_cgroups.EFFECTIVE}") and f"pod{UID}/{CONTAINER}" in f for f in files)
    code, plan, err = run_plan(str(tmp_path / "snap"), ["--pid", str(w.pid), "--npu", "0", "--small-pool", "share"])
    assert code == 0, err
    assert plan["npus"]["0"]["pool"] == [CPUS[-1]] and plan["pool_source"]["source"] == "cpuset"
