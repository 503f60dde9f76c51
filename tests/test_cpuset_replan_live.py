"""A bound worker's cpuset changes under it: the daemon plans it again, and never blames a tool.

A real worker with named threads lives in a pod-shaped cpuset cgroup
(``ascendbind-test-<pid>/kubepods/pod<uid>/<id>``, tests/cpuset_cgroups.py, on v1 or v2),
bound by a real daemon with ``pool_source = auto`` and kubelet's CPU manager checkpoint
in a temporary ``kubelet_root``, as tests/test_pool_source_live.py does: the fixture
host's two NPUs share every CPU, so only the checkpoint's proof makes the worker's own
cpuset its pool. Then the pod's CPUs change the way kubelet changes them (its checkpoint,
then the container's ``cpuset.cpus``): the kernel moves the threads itself, and the test
waits (polling with a deadline) until every thread, read back from
``/proc/<pid>/task/*/status``, is on the new plan's CPUs, the worker is not left alone,
and its drift is blamed ``cpuset``; then the pod gets its CPUs back and the same holds
again. The CPUs come from this process's allowed mask. The cgroups are removed and the
workers reaped whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest

from tests import cpuset_cgroups
from tests.daemon_harness import PATIENCE, kubelet_node, metric_value, wait_for
from tests.workers import cpus_allowed_of, start_worker

CPUS = sorted(os.sched_getaffinity(0))
ALL = ",".join(map(str, CPUS))
UID = "7a6b5c4d-3e2f-4a1b-8c9d-0e1f2a3b4c5d"
CONTAINER = "c7" * 32
WAIT = 20.0 * PATIENCE  # reconcile_seconds is 1: a re-plan lands within a pass or two

pytestmark = [
    pytest.mark.skipif(len(CPUS) < 2 and not os.environ.get("CI"), reason="moving a cpuset needs 2 CPUs"),
    pytest.mark.skipif(cpuset_cgroups.why_not() is not None and not os.environ.get("CI"),
                       reason=str(cpuset_cgroups.why_not())),
]


@pytest.fixture(scope="module")
def node():
    """(daemon, kubelet_root) on the fixture two-NPU host."""
    with kubelet_node("ascendbind-cpuset-") as pair:
        yield pair


def checkpoint(kubelet: str, cpus: str) -> None:
    """kubelet's static CPU manager giving the pod's container ``cpus``; written the way kubelet
    writes it (a new file renamed over the old one)."""
    mine = {int(c) for c in cpus.split(",")}
    shared = ",".join(str(c) for c in CPUS if c not in mine)
    path = os.path.join(kubelet, "cpu_manager_state")
    with open(path + ".tmp", "w") as fh:
        json.dump({"policyName": "static", "defaultCpuSet": shared, "entries": {UID: {"vllm": cpus}},
                   "checksum": 1}, fh)
    os.replace(path + ".tmp", path)


@contextlib.contextmanager
def pod_worker(cpus: str):
    """A worker with named threads in a pod's container cgroup limited to ``cpus`` (its parents
    hold every CPU, so the container can be given others)."""
    with cpuset_cgroups.cpuset_tree(["kubepods", f"pod{UID}", CONTAINER], cpus, parents=ALL,
                                     at_root=True) as cg, \
            start_worker(plain=2, acl=1, release=1) as w:
        cpuset_cgroups.move(cg, w.pid)
        yield cg, w


@contextlib.contextmanager
def bound_pod_worker(d, kubelet: str, cpus: str):
    """``pod_worker`` on ``cpus``, which kubelet's checkpoint gives its pod, bound to NPU 0:
    (cgroup, worker, the bind's answer)."""
    checkpoint(kubelet, cpus)
    with pod_worker(cpus) as (cg, w):
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, (body, story(d))
        yield cg, w, body


def thread_masks(pid: int) -> dict[str, frozenset[int] | None]:
    """comm -> Cpus_allowed_list of every thread, read from /proc."""
    out = {}
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                out[f"{fh.read().strip()}/{tid}"] = cpus_allowed_of(pid, tid)
        except OSError:
            continue
    return out


def want_of(plan_npu: dict, name: str) -> frozenset[int]:
    role = "acl" if name.startswith("acl_thread") else "release" if name.startswith("release_thread") else "main"
    return frozenset(plan_npu[role])


def replanned_onto(d, w, cpus: list[int]) -> bool:
    """The worker is bound by a plan whose pool is ``cpus``, every thread is on its role's CPUs
    of that plan, and it is not left alone."""
    x = d.worker_entry(w.pid)
    npu = x["plan"]["npus"]["0"]
    if npu["pool"] != cpus or x["drift"]["left_alone"]:
        return False
    return all(mask == want_of(npu, name) for name, mask in thread_masks(w.pid).items())


def story(d) -> str:
    """The daemon's log without its request lines: what it did, for a failure's message."""
    return "\n".join([ln for ln in d.log().splitlines() if '"event": "request"' not in ln][-25:])


def replans(d, reason: str, outcome: str) -> float:
    return metric_value(d.metrics_text(), "ascendbind_replans_total", reason=reason, outcome=outcome) or 0.0


def passes(d) -> float:
    return metric_value(d.metrics_text(), "ascendbind_reconcile_runs_total") or 0.0


def stays(d, w, cpus: list[int], more: int = 3) -> None:
    """``more`` further passes leave it bound there: nothing re-asserts, nothing gives up."""
    start = passes(d)
    assert wait_for(lambda: passes(d) >= start + more, WAIT), story(d)
    assert replanned_onto(d, w, cpus), (d.worker_entry(w.pid), thread_masks(w.pid), story(d))


def test_a_pod_whose_cpus_move_is_planned_again_each_time_and_never_blamed_external(node):
    d, kubelet = node
    here, there = CPUS[-1], CPUS[0]
    with bound_pod_worker(d, kubelet, str(here)) as (cg, w, body):
        assert body["plan"]["npus"]["0"]["pool"] == [here] and body["plan"]["pool_source"]["source"] == "cpuset"
        before = replans(d, "cpuset_changed", "rebound")
        external = metric_value(d.metrics_text(), "ascendbind_drift_total", culprit="external")

        # kubelet moves the pod: its checkpoint first, then the container's cpuset
        checkpoint(kubelet, str(there))
        cpuset_cgroups.set_cpus(cg, str(there))
        moved_at = time.monotonic()
        assert cpuset_cgroups.effective(cg) == str(there)
        assert wait_for(lambda: replanned_onto(d, w, [there]), WAIT), \
            (d.worker_entry(w.pid), thread_masks(w.pid), story(d))
        print(f"\nplanned again {time.monotonic() - moved_at:.2f} s after the cpuset moved (reconcile_seconds = 1)")
        x = d.worker_entry(w.pid)
        assert x["drift"]["culprit"] == "cpuset" and "cpuset changed" in x["drift"]["blame"], x["drift"]
        assert x["cpulists"]["allowed"] == str(there) and x["plan"]["pool_source"]["source"] == "cpuset"
        stays(d, w, [there])

        # and back again
        checkpoint(kubelet, str(here))
        cpuset_cgroups.set_cpus(cg, str(here))
        assert wait_for(lambda: replanned_onto(d, w, [here]), WAIT), \
            (d.worker_entry(w.pid), thread_masks(w.pid), story(d))
        stays(d, w, [here])
        x = d.worker_entry(w.pid)
        assert x["drift"]["culprit"] == "cpuset" and not x["drift"]["left_alone"], x["drift"]
        text = d.metrics_text()
        assert replans(d, "cpuset_changed", "rebound") >= before + 2
        assert metric_value(text, "ascendbind_drift_total", culprit="cpuset") >= 2
        assert metric_value(text, "ascendbind_drift_total", culprit="external") == external
        assert "cpuset_changed" in d.log()
        d.curl("POST", "/v1/release", {"pid": w.pid})


def test_a_cpuset_no_plan_fits_waits_for_kubelets_proof_and_a_widened_one_is_planned_whole(node):
    d, kubelet = node
    here, there = CPUS[-1], CPUS[0]
    with bound_pod_worker(d, kubelet, str(here)) as (cg, w, body):
        # the container's cpuset moves before the checkpoint says so: no proof the CPU is the
        # pod's own, and the placement rules leave NPU 0 nothing of one CPU shared with NPU 1
        cpuset_cgroups.set_cpus(cg, str(there))

        def stuck() -> bool:
            drift = d.worker_entry(w.pid)["drift"]
            return drift["left_alone"] and drift["culprit"] == "cpuset" and "no plan fits" in drift["left_alone_why"]
        assert wait_for(stuck, WAIT), f"{d.worker_entry(w.pid)['drift']}\n{story(d)}"
        # nothing fights the kernel meanwhile: the threads stay where it put them
        assert set(thread_masks(w.pid).values()) == {frozenset({there})}
        assert replans(d, "cpuset_changed", "failed") >= 1

        checkpoint(kubelet, str(there))  # kubelet catches up: the proof re-plans it
        assert wait_for(lambda: replanned_onto(d, w, [there]), WAIT), \
            (d.worker_entry(w.pid), thread_masks(w.pid), story(d))
        assert replans(d, "checkpoint_changed", "rebound") >= 1

        # the pod gets every CPU: no thread leaves its CPUs (the kernel keeps the masks it was
        # given inside a wider set), yet the plan takes the whole new cpuset
        checkpoint(kubelet, ALL)
        cpuset_cgroups.set_cpus(cg, ALL)
        assert wait_for(lambda: replanned_onto(d, w, CPUS), WAIT), \
            (d.worker_entry(w.pid), thread_masks(w.pid), story(d))
        stays(d, w, CPUS)
        d.curl("POST", "/v1/release", {"pid": w.pid})
