"""The 4node guest: four NUMA nodes of two CPUs each, with distances where node 0's
nearest neighbour is node 2 (12), not the next node, 1 (30). The fixture npu-smi puts
NPU 0's affinity on node 0 (CPUs 0-1), so a ``topo_affinity`` pool lies on one node and
is extended: to node 1 with ``numa_extension = next``, to node 2 with ``closest``,
from the distances discovery reads off this kernel's sysfs."""

from __future__ import annotations

import os

import pytest

from tests.daemon_harness import running_daemon, wait_for
from tests.memworker_client import mem_worker
from tests.numa.conftest import plan_json, recorded_npu_smi
from tests.workers import cpus_allowed_of

SLOW = 600.0


@pytest.fixture(scope="module")
def npu_env(tmp_path_factory):
    """One NPU whose affinity is node 0's CPUs, recorded once (see conftest.py)."""
    return {"ASCENDBIND_NPU_SMI": recorded_npu_smi(str(tmp_path_factory.mktemp("npu-smi")), 1, "0-1")}


def test_the_kernels_distances_are_the_guests():
    with open("/sys/devices/system/node/node0/distance") as fh:
        assert fh.read().split() == ["10", "30", "12", "40"]


def test_the_extension_follows_the_kernels_distances(npu_env):
    nxt = plan_json(npu_env, "--numa-extension", "next")["npus"]["0"]
    closest = plan_json(npu_env, "--numa-extension", "closest")["npus"]["0"]
    assert nxt["numa_nodes"] == [0, 1] and nxt["pool"] == [0, 1, 2, 3]
    assert closest["numa_nodes"] == [0, 2] and closest["pool"] == [0, 1, 4, 5]


def test_a_closest_bind_puts_threads_and_memory_on_the_plans_nodes(tmp_path, npu_env):
    with running_daemon(str(tmp_path), ready_timeout=SLOW, ASCENDBIND_NUMA_EXTENSION="closest",
                        ASCENDBIND_MEMORY_CHECK_SECONDS="1", **npu_env) as d, \
            mem_worker(private_mib=32, threads=("acl_thread", "release_thread"), membind=3) as w:
        d.wait_discovered(SLOW)
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0}, timeout=SLOW)
        assert status == 200, body
        assert body["plan"]["npus"]["0"]["pool"] == [0, 1, 4, 5]
        masks = {tid: cpus_allowed_of(w.pid, int(tid)) for tid in os.listdir(f"/proc/{w.pid}/task")}
        assert all(m and m <= {0, 1, 4, 5} for m in masks.values()), masks  # every thread on the plan's pool
        assert set().union(*masks.values()) == {0, 1, 4, 5}, masks

        def moved() -> bool:
            return d.client.workers()["workers"][0]["memory"]["state"] == "done"

        assert wait_for(moved, SLOW), d.client.workers()
        # pool[0] is CPU 0: the pages went to node 0, from the farthest node
        with open(f"/proc/{w.pid}/numa_maps") as fh:
            anon: dict[str, int] = {}
            for line in fh:
                if "file=" in line:
                    continue
                for word in line.split():
                    key, _, value = word.partition("=")
                    if key[:1] == "N" and key[1:].isdigit():
                        anon[key[1:]] = anon.get(key[1:], 0) + int(value)
        assert anon.get("0", 0) >= 0.9 * sum(anon.values()), anon
        d.client.release(w.pid)
