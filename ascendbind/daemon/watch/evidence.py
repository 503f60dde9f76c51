"""Read what the blame rule (blame.py) weighs: a worker's environment, and the command
lines of the worker and its nearest ancestors.

Read only when a drift is seen (rare), through discovery (bounded: environ up
to 256 KiB, each command line up to 64 KiB, each within a deadline), at most
``MAX_ANCESTORS`` parents, never past pid 1. A process that vanishes, cannot be
read or does not answer in time simply contributes no evidence.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator

from ...discovery.read.tasks import parent_pid, read_cmdline, read_environ
from .blame import Evidence, environ_evidence, first_vllm_setting, split_cmdline

__all__ = ["read_evidence", "MAX_ANCESTORS", "is_arm"]

# the vLLM server is the worker's parent or grandparent (API server -> engine core -> worker)
MAX_ANCESTORS = 4


def _lineage(pid: int, proc_root: str) -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of the worker, then of each ancestor, nearest first."""
    seen: set[int] = set()
    cur: int | None = pid
    for _ in range(1 + MAX_ANCESTORS):
        if cur is None or cur <= 1 or cur in seen:
            return
        seen.add(cur)
        yield cur, split_cmdline(read_cmdline(cur, proc_root))
        cur = parent_pid(cur, proc_root)


def is_arm(machine: str | None = None) -> bool:
    m = (machine if machine is not None else platform.machine()).lower()
    return m.startswith(("aarch64", "arm"))


def read_evidence(pid: int, proc_root: str = "/proc", *, machine: str | None = None) -> Evidence:
    torch_npu, openmp = environ_evidence(read_environ(pid, proc_root))
    vllm, vllm_pid = first_vllm_setting(_lineage(pid, proc_root))
    return Evidence(torch_npu=torch_npu, vllm=vllm, vllm_pid=vllm_pid, openmp=openmp, arm=is_arm(machine))
