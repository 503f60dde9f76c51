"""NUMA alignment through the daemon: a bind whose seed pool lies off the NPU's node counts
``unaligned``; a bind that ``restricted`` refuses counts ``failed`` plus an
alignment-failure reason. The worker is a real process bound for real;
the host's static facts come from a two-node snapshot of this machine's CPUs 0-1
(a fake topology: CI has one NUMA node), the worker's facts from the live /proc.
"""

import importlib.util
import os
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ascendbind.settings import load_config
from ascendbind.daemon.api.auth import Peer
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.discovery import LiveHost, SnapshotHost
from ascendbind.errors import PlanImpossible
from tests.workers import start_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("hostgen", os.path.join(ROOT, "fixtures", "hostgen.py"))
g = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(g)

pytestmark = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")


def two_node_host(d):
    """CPU 0 on NUMA 0, CPU 1 on NUMA 1; NPU0 and NPU1 both have affinity CPU 0."""
    def put(rel, text):
        path = os.path.join(d, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)

    cards = [(k, "910B3", "OK", "90.0", 40, [("0", f"0000:c{k}:00.0", 0, 3300, 65536)]) for k in range(2)]
    put("cmd/npu-smi_info.txt", g.npu_smi_info("24.1.0", cards, {}))
    put("cmd/npu-smi_info_-m.txt", g.npu_smi_m(("NPU ID", "Chip ID", "Chip Logic ID", "Chip Name"),
                                               [(0, 0, 0, "Ascend 910B3"), (1, 0, 1, "Ascend 910B3")]))
    put("cmd/npu-smi_info_-t_topo.txt", g.npu_smi_topo(["NPU0", "NPU1"], lambda i, j: "X" if i == j else "HCCS",
                                                       ["0", "0"]))
    put("cmd/lscpu_-e.txt", g.lscpu_e([(0, 0, 0, 0, "0:0:0:0", True), (1, 1, 1, 1, "1:1:1:1", True)]))
    put("cmd/lscpu.txt", g.lscpu([("Architecture", "aarch64"), ("CPU(s)", "2"), ("Thread(s) per core", "1"),
                                  ("NUMA node(s)", "2"), ("NUMA node0 CPU(s)", "0"), ("NUMA node1 CPU(s)", "1")]))
    for node, dist in ((0, "10 20"), (1, "20 10")):
        put(f"sys/devices/system/node/node{node}/distance", dist + "\n")
        put(f"sys/devices/system/node/node{node}/cpulist", f"{node}\n")


class SplitSource:
    """Static host facts from a snapshot; everything about live processes from this host."""

    _live_path = re.compile(r"^/proc/(\d+|self)(/|$)|^/sys/fs/cgroup/")

    def __init__(self, snapshot_dir):
        self.snap = SnapshotHost(snapshot_dir)
        self.live = LiveHost()

    def run(self, argv):
        return self.live.run(argv) if argv[0] == "ps" else self.snap.run(argv)

    def read(self, path, limit=None):
        return (self.live if self._live_path.match(path) else self.snap).read(path, limit=limit)

    def open_process(self, key):
        return self.live.open_process(key)

    def listdir(self, path):
        return (self.live if self._live_path.match(path) or path == "/proc" else self.snap).listdir(path)


def samples(daemon):
    text = daemon.metrics.render().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_bind_outcomes_unaligned_then_failed_by_policy(tmp_path):
    two_node_host(str(tmp_path / "host"))
    config = load_config(None, env={}, overrides={"small_pool": "share", "irq_binding": "false"}).replace(
        state_dir=str(tmp_path / "state"))
    daemon = Daemon(config, source=SplitSource(str(tmp_path / "host")))
    root = Peer(pid=os.getpid(), uid=0, gid=0)
    with start_worker(plain=1, acl=1, release=1) as w:
        # every CPU this machine lets the worker use (two here, maybe more on another machine):
        # the host's facts know only CPUs 0-1, the worker's own mask is the live one
        unbound = set(w.cpus_allowed().values())
        assert unbound == {frozenset(os.sched_getaffinity(0))}
        try:
            result = daemon.bind_request(root, {"pid": w.pid, "npu": 1})
            # the placement rules: NPU0 and NPU1 share the extended pool 0-1, NPU1 takes CPU 1 on NUMA 1,
            # while its device sits on NUMA 0
            assert result["plan"]["npus"]["1"]["pool"] == [1]
            assert result["outcome"] == "unaligned"
            assert set(w.cpus_allowed().values()) == {frozenset({1})}
            daemon.release_pid(w.pid)

            # NPU0 under restricted: NUMA 0's one CPU is split between NPU0 and NPU1 and
            # gives NPU0 nothing; device (NUMA 0) and cpu (NUMA 1) disagree -> refused
            with pytest.raises(PlanImpossible, match="device wants NUMA 0"):
                daemon.bind_request(root, {"pid": w.pid, "npu": 0, "topology_policy": "restricted"})
            assert set(w.cpus_allowed().values()) == unbound, "a refused bind changes nothing"
        finally:
            daemon.release_pid(w.pid) if w.pid in daemon.held else None
            daemon.close()
    s = samples(daemon)
    assert s[("ascendbind_bind_requests_total", (("outcome", "unaligned"),))] == 1
    assert s[("ascendbind_bind_requests_total", (("outcome", "failed"),))] == 1
    assert s[("ascendbind_bind_requests_total", (("outcome", "aligned"),))] == 0
    failures = {dict(k[1])["reason"]: v for k, v in s.items() if k[0] == "ascendbind_alignment_failures_total"}
    assert sum(failures.values()) == 2, failures  # the unaligned admit and the refusal
    assert failures.get("other", 0) == 0, "reasons come from the planner's fixed set"
