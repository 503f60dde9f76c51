"""The memory step: move a bound worker's pages to its pool's NUMA node (``migratepages``).

``migratepages <pid> <all nodes> <node of pool[0]>`` (numactl package) moves the
pages the worker already touched; pages it allocates later follow the first-touch
policy of the CPUs it now runs on. Moving pages of another user's process needs
CAP_SYS_PTRACE; a large heap takes seconds, so the command gets a longer
timeout than the discovery commands.

Where a worker's memory lives is measured by discovery
(``discovery.numa_maps``); the daemon's locality check runs this step again
when too little of it is on the pool's nodes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from ..command import run_command
from ..config import Config
from ..model import HostFacts, Outcome, Plan, Reason, Step, StepResult, frozen_map

__all__ = [
    "MIGRATE_TIMEOUT_FLOOR",
    "run_migratepages",
    "migrate_memory",
]

# seconds; the configured command timeout is for npu-smi/lscpu, far too short for 100 GiB
MIGRATE_TIMEOUT_FLOOR = 120.0


def run_migratepages(
    pid: int, from_nodes: Sequence[int], to_node: int, *, timeout: float = MIGRATE_TIMEOUT_FLOOR
) -> StepResult:
    """Run ``migratepages <pid> <from> <to>`` (argv, no shell) and report its exit status."""
    exe = shutil.which("migratepages")
    if exe is None:
        return _result(
            Outcome.SKIPPED, Reason.MIGRATEPAGES_MISSING,
            "migratepages not found (install numactl); pages stay where they are",
        )
    argv = [exe, str(int(pid)), ",".join(str(int(n)) for n in from_nodes), str(int(to_node))]
    shown = " ".join(["migratepages", *argv[1:]])
    env = {"LC_ALL": "C", "LANG": "C", "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    data = {"argv": argv[1:], "target_node": to_node}
    try:
        proc = run_command(argv, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return _result(Outcome.FAILED, Reason.MIGRATEPAGES_FAILED, f"{shown} timed out after {timeout:g}s", data)
    except OSError as exc:
        return _result(Outcome.FAILED, Reason.MIGRATEPAGES_FAILED, f"{shown} could not start: {exc.strerror}", data)
    data["exit_status"] = proc.returncode
    stderr = proc.stderr.strip()
    if stderr:
        data["stderr"] = stderr[-500:]
    if proc.returncode != 0:
        tail = stderr.splitlines()[-1] if stderr else "no output"
        return _result(Outcome.FAILED, Reason.MIGRATEPAGES_FAILED, f"{shown} exited {proc.returncode}: {tail}", data)
    return _result(Outcome.APPLIED, None, f"{shown}: pages moved to NUMA node {to_node}", data)


def migrate_memory(plan: Plan, pid: int, host: HostFacts, config: Config) -> StepResult:
    """The memory step: target = NUMA node of the first target NPU's ``pool[0]``."""
    nodes = sorted(host.numa_nodes)
    if not nodes or not plan.npus or not plan.npus[0].pool:
        return _result(Outcome.SKIPPED, Reason.NO_NUMA_INFO, "no NUMA node list from lscpu/sysfs")
    if len(nodes) == 1:
        return _result(Outcome.SKIPPED, Reason.SINGLE_NUMA_NODE, f"one NUMA node ({nodes[0]}): nothing to move")
    anchor = plan.npus[0].pool[0]
    target = host.node_of_cpu(anchor)
    if target is None:
        return _result(Outcome.SKIPPED, Reason.NO_NUMA_INFO, f"CPU {anchor} (pool[0]) is on no known NUMA node")
    return run_migratepages(pid, nodes, target, timeout=max(config.command_timeout_seconds, MIGRATE_TIMEOUT_FLOOR))


def _result(outcome: Outcome, reason: Reason | None, detail: str, data: dict | None = None) -> StepResult:
    return StepResult(Step.MEMORY, outcome, reason, detail, frozen_map(data))
