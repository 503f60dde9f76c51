"""Read what the blame rule (blame.py) weighs: a worker's environment, and the command
lines of the worker and its nearest ancestors.

Read only when a drift is seen (rare), bounded: environ up to 1 MiB, each command
line up to 64 KiB, at most ``MAX_ANCESTORS`` parents, never past pid 1. A process
that vanishes or cannot be read simply contributes no evidence.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator

from ..discovery.procfs import parse_environ
from .blame import Evidence, environ_evidence, first_vllm_setting, split_cmdline

__all__ = ["read_evidence", "MAX_ANCESTORS", "is_arm"]

# the vLLM server is the worker's parent or grandparent (API server -> engine core -> worker)
MAX_ANCESTORS = 4


def _read(path: str, limit: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        out = b""
        while len(out) < limit:
            chunk = os.read(fd, min(65536, limit - len(out)))
            if not chunk:
                break
            out += chunk
        return out
    except OSError:
        return b""
    finally:
        os.close(fd)


def _ppid(pid: int, proc_root: str) -> int | None:
    text = _read(f"{proc_root}/{pid}/stat", 4096).decode("utf-8", "replace")
    rest = text[text.rfind(")") + 1:].split()
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return None


def _lineage(pid: int, proc_root: str) -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of the worker, then of each ancestor, nearest first."""
    seen: set[int] = set()
    cur: int | None = pid
    for _ in range(1 + MAX_ANCESTORS):
        if cur is None or cur <= 1 or cur in seen:
            return
        seen.add(cur)
        yield cur, split_cmdline(_read(f"{proc_root}/{cur}/cmdline", 65536))
        cur = _ppid(cur, proc_root)


def is_arm(machine: str | None = None) -> bool:
    m = (machine if machine is not None else platform.machine()).lower()
    return m.startswith(("aarch64", "arm"))


def read_evidence(pid: int, proc_root: str = "/proc", *, machine: str | None = None) -> Evidence:
    env = parse_environ(_read(f"{proc_root}/{pid}/environ", 1 << 20).decode("utf-8", "replace"))
    torch_npu, openmp = environ_evidence(env)
    vllm, vllm_pid = first_vllm_setting(_lineage(pid, proc_root))
    return Evidence(torch_npu=torch_npu, vllm=vllm, vllm_pid=vllm_pid, openmp=openmp, arm=is_arm(machine))
