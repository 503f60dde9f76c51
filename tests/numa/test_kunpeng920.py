"""The arm64 guest (tests/arm64_guest.py): Debian's arm64 kernel, eight CPUs on four NUMA
nodes of two (node k = CPUs 2k, 2k+1) with a Kunpeng 920's distances. Node 3's nearest
neighbour is node 2 (16) while its next node, 0, is the farthest (33): the fixture
npu-smi puts NPU 0's affinity on node 3 (CPUs 6-7), so a ``topo_affinity`` pool lies on
one node and is extended to node 0 with ``numa_extension = next``, to node 2 with
``closest``. Every number here is read off this kernel, not assumed from the host."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from ascendbind.discovery.parse.lscpu import parse_lscpu, parse_lscpu_e
from tests.daemon_harness import ROOT, running_daemon, wait_for
from tests.memworker_client import mem_worker
from tests.numa.conftest import plan_json, recorded_npu_smi
from tests.workers import cpus_allowed_of

SLOW = 600.0
DISTANCES = ([10, 16, 32, 33], [16, 10, 25, 32], [32, 25, 10, 16], [33, 32, 16, 10])


@pytest.fixture(scope="module")
def npu_env(tmp_path_factory):
    """One NPU whose affinity is node 3's CPUs, recorded once (see conftest.py)."""
    return {"ASCENDBIND_NPU_SMI": recorded_npu_smi(str(tmp_path_factory.mktemp("npu-smi")), 1, "6-7")}


def test_an_arm64_kernel_with_a_kunpeng_920s_distances_and_its_lscpu():
    assert platform.machine() == "aarch64"
    for node, want in enumerate(DISTANCES):
        with open(f"/sys/devices/system/node/node{node}/distance") as fh:
            assert [int(d) for d in fh.read().split()] == want, node
    env = {"LC_ALL": "C", "PATH": os.environ["PATH"]}
    texts = {name: subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
             for name, argv in (("lscpu", ["lscpu"]), ("lscpu_-e", ["lscpu", "-e"]))}
    out = os.environ.get("NUMA_GUEST_OUT")
    if out:  # the host keeps them (fixtures/arm64-guest/)
        for name, text in texts.items():
            with open(os.path.join(out, f"{name}.txt"), "w") as fh:
                fh.write(text)
    summary, cpus = parse_lscpu(texts["lscpu"]), parse_lscpu_e(texts["lscpu_-e"])
    assert (summary.architecture, summary.cpu_count, summary.numa_node_count) == ("aarch64", 8, 4)
    assert {c.cpu: c.node for c in cpus} == {k: k // 2 for k in range(8)}


def test_next_and_closest_extend_to_different_nodes_on_asymmetric_distances(npu_env):
    nxt = plan_json(npu_env, "--numa-extension", "next")["npus"]["0"]
    closest = plan_json(npu_env, "--numa-extension", "closest")["npus"]["0"]
    assert nxt["numa_nodes"] == [0, 3] and nxt["pool"] == [0, 1, 6, 7]
    assert closest["numa_nodes"] == [2, 3] and closest["pool"] == [4, 5, 6, 7]


def test_ascendbind_plan_reads_this_kernel_live(npu_env):
    r = subprocess.run([sys.executable, "-m", "ascendbind.cli", "plan", "--npu", "0", "--small-pool", "share",
                        "--numa-extension", "closest", "--format", "json"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, **npu_env, "ASCENDBIND_CONFIG": "", "PYTHONPATH": str(ROOT)}, timeout=SLOW)
    assert r.returncode == 0, r.stderr
    npu = json.loads(r.stdout)["npus"]["0"]
    assert npu["numa_nodes"] == [2, 3] and npu["pool"] == [4, 5, 6, 7]


def test_a_daemon_bind_puts_threads_on_the_pool_and_memory_on_pool0s_node(tmp_path, npu_env):
    # the worker's pages start on node 0, the farthest from node 2 (pool[0] = CPU 4)
    with running_daemon(str(tmp_path), ready_timeout=SLOW, ASCENDBIND_NUMA_EXTENSION="closest",
                        ASCENDBIND_MEMORY_CHECK_SECONDS="1", **npu_env) as d, \
            mem_worker(private_mib=32, threads=("acl_thread", "release_thread"), membind=0) as w:
        d.wait_discovered(SLOW)
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0}, timeout=SLOW)
        assert status == 200, body
        assert body["plan"]["npus"]["0"]["pool"] == [4, 5, 6, 7]
        masks = {tid: cpus_allowed_of(w.pid, int(tid)) for tid in os.listdir(f"/proc/{w.pid}/task")}
        assert all(m and m <= {4, 5, 6, 7} for m in masks.values()), masks
        assert set().union(*masks.values()) == {4, 5, 6, 7}, masks
        assert wait_for(lambda: d.client.workers()["workers"][0]["memory"]["state"] == "done", SLOW), \
            d.client.workers()
        with open(f"/proc/{w.pid}/numa_maps") as fh:
            anon: dict[str, int] = {}
            for line in fh:
                if "file=" in line:
                    continue
                for word in line.split():
                    key, _, value = word.partition("=")
                    if key[:1] == "N" and key[1:].isdigit():
                        anon[key[1:]] = anon.get(key[1:], 0) + int(value)
        assert anon.get("2", 0) >= 0.9 * sum(anon.values()), anon
        d.client.release(w.pid)
