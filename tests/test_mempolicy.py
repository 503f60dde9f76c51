"""The memory policy ``ascendbind run`` sets before exec (ascendbind/mempolicy.py), in child processes.

A task's policy is its own and survives exec, so each case runs in a fresh child
that sets it and then execs a reader of its own ``/proc/self/numa_maps``: the
kernel's word on the policy the command starts with. This host has one NUMA node;
the two-node guest checks where 512 MiB of a command's memory lands
(tests/numa/test_pool_cgroup_v2.py).
"""

from __future__ import annotations

import subprocess
import sys

from ascendbind.mempolicy import mems_allowed, pool_nodes
from tests.daemon_harness import ROOT

_CHILD = """
import json, os, sys
from ascendbind.mempolicy import prefer_nodes
plan, status = json.loads(sys.argv[1]), sys.argv[2] or None
print(prefer_nodes(plan, status_text=status), flush=True)
os.execv(sys.executable, [sys.executable, "-c",
         "print(open('/proc/self/numa_maps').readline().split()[1])"])
"""


def run_child(plan: dict, status: str = "") -> tuple[str, str]:
    import json

    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(plan), status], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=60)
    assert r.returncode == 0, r.stderr
    note, policy = r.stdout.strip().splitlines()
    return note, policy


def plan_on(*nodes_per_npu):
    return {"npus": {str(i): {"numa_nodes": list(n)} for i, n in enumerate(nodes_per_npu)}}


def test_one_node_pool_is_preferred_and_survives_exec():
    note, policy = run_child(plan_on([0]))
    assert note == "memory preferred on NUMA node 0 (MPOL_PREFERRED)" and policy == "prefer:0"


def test_mems_allowed_is_never_widened():
    note, policy = run_child(plan_on([0]), "Name:\tx\nMems_allowed_list:\t1\n")
    assert "outside this task's Mems_allowed 1" in note and policy == "default"


def test_a_plan_without_nodes_leaves_the_policy_alone():
    note, policy = run_child({"npus": {}})
    assert "names no NUMA node" in note and policy == "default"


def test_parsers_take_only_what_they_understand():
    assert mems_allowed("Mems_allowed_list:\t0-1,3\n") == frozenset({0, 1, 3})
    assert mems_allowed("Mems_allowed_list:\tx\n") is None and mems_allowed("Name: a\n") is None
    assert pool_nodes(plan_on([1], [0, 1])) == (1, (0, 1))
    assert pool_nodes({"npus": {"0": {"numa_nodes": [-1, "2", 5000]}}}) == (None, ())
