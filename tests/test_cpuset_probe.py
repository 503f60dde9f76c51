"""The cpuset probe on this host: a real cpuset cgroup, a real process in it, one pread a look.

The cgroup is made on whichever hierarchy this machine has (tests/cpuset_cgroups.py) and
removed whatever happens; the CPUs come from this process's allowed mask.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ascendbind.discovery.gather.cpusetprobe import checkpoint_stamp, open_cpuset_probe
from ascendbind.discovery.read.sources import LiveHost
from tests import cpuset_cgroups

CPUS = sorted(os.sched_getaffinity(0))
ALL = ",".join(map(str, CPUS))

# in CI (CI set) a machine without either is a failure, not a skip
@pytest.mark.skipif(len(CPUS) < 2 and not os.environ.get("CI"), reason="moving a cpuset needs 2 CPUs")
@pytest.mark.skipif(cpuset_cgroups.why_not() is not None and not os.environ.get("CI"),
                    reason=str(cpuset_cgroups.why_not()))
def test_the_probe_reads_the_cgroups_cpus_afresh_and_says_none_once_it_is_removed():
    here, there = CPUS[-1], CPUS[0]
    with cpuset_cgroups.cpuset_tree(["probe"], str(here), parents=ALL) as cg:
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            cpuset_cgroups.move(cg, child.pid)
            probe = open_cpuset_probe(LiveHost(), child.pid)
            assert probe is not None and probe.path.endswith(cpuset_cgroups.EFFECTIVE)
            assert probe.cpus() == {here}
            cpuset_cgroups.set_cpus(cg, str(there))
            assert probe.cpus() == {there}
            cpuset_cgroups.set_cpus(cg, ALL)
            assert probe.cpus() == set(CPUS)
        finally:
            child.stdin.close()
            child.wait(timeout=10)
    assert probe.cpus() is None  # the cgroup is gone: ENODEV, not a stale answer
    probe.close()
    assert probe.cpus() is None


def test_no_probe_for_a_process_that_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)
    assert open_cpuset_probe(LiveHost(), child.pid) is None


def test_the_checkpoint_stamp_changes_when_kubelet_renames_a_new_checkpoint_over_it(tmp_path):
    host = LiveHost(kubelet_root=str(tmp_path))
    assert checkpoint_stamp(host) is None
    path = tmp_path / "cpu_manager_state"

    def write(cpus: str) -> None:
        (tmp_path / "new").write_text(json.dumps({"policyName": "static", "defaultCpuSet": "",
                                                   "entries": {"u": {"c": cpus}}, "checksum": 1}))
        os.replace(tmp_path / "new", path)

    write("1")
    first = checkpoint_stamp(host)
    assert first is not None and checkpoint_stamp(host) == first
    write("0")  # same size: the inode says it changed
    assert checkpoint_stamp(host) != first
