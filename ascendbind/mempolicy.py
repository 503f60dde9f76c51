"""The memory policy ``ascendbind run`` gives its command: its pool's node(s) preferred, from the first page.

The daemon moves a bound worker's private pages to its pool's node after the
bind, but what the worker pins for the NPU's DMA (host buffers registered with
the driver) cannot move (``EBUSY``), and a model loaded before the move was
placed wherever the scheduler ran it. ``run`` starts the command, so it sets
the policy in the forked child after the bind and before ``exec``: a task's
memory policy survives ``execve(2)`` and is inherited by every thread and child
it creates, so everything the command allocates starts on the pool's node.

The policy, in order:

* ``MPOL_PREFERRED_MANY`` (Linux 5.15) over the pool's nodes when the pool
  spans several: allocations come from the nearest of them and fall back to
  other nodes only when all are full;
* ``MPOL_PREFERRED`` on one node otherwise, and where the kernel refuses
  ``PREFERRED_MANY`` (``EINVAL``): the node of the pool's first CPU, the node
  the daemon's memory step moves pages to. Preferred, never bound: a full node
  spills over rather than making the worker fail to allocate (``MPOL_BIND``
  would invoke the OOM killer on the node instead).

What is never widened: the nodes are intersected with the task's
``Mems_allowed`` (its cpuset's ``cpuset.mems``, which kubelet's Memory Manager
and ``docker run --cpuset-mems`` set); an empty intersection leaves the policy
alone. A task that already has a policy of its own (``numactl``, a launcher's
``set_mempolicy``) keeps it. Each case is one sentence for ``run``'s stderr.

Stdlib only (``ctypes``): workers import the client alone.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Iterable

__all__ = ["MPOL_DEFAULT", "MPOL_PREFERRED", "MPOL_PREFERRED_MANY", "prefer_nodes", "pool_nodes",
           "mems_allowed", "current_policy"]

MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_LOCAL = 4
MPOL_PREFERRED_MANY = 5

# (get_mempolicy, set_mempolicy) by machine: the generic table (arm64, riscv) and x86-64
_SYSCALLS = {"x86_64": (239, 238), "aarch64": (236, 237), "arm64": (236, 237), "riscv64": (236, 237)}
_MAX_NODE = 1024  # bits of the node masks passed to the kernel (its MAX_NUMNODES is at most 1024)
_WORDS = _MAX_NODE // (8 * ctypes.sizeof(ctypes.c_ulong))


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mask(nodes: Iterable[int]):
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = (ctypes.c_ulong * _WORDS)()
    for n in nodes:
        words[n // bits] |= 1 << (n % bits)
    return words


def current_policy() -> int | None:
    """This task's memory policy mode (MPOL_*), None where it cannot be read."""
    nrs = _SYSCALLS.get(platform.machine())
    if nrs is None:
        return None
    mode = ctypes.c_int(0)
    if _libc().syscall(nrs[0], ctypes.byref(mode), None, ctypes.c_ulong(0), None, ctypes.c_ulong(0)) != 0:
        return None
    return mode.value


def _set(mode: int, nodes: Iterable[int]) -> int:
    """0, or the errno of set_mempolicy(2)."""
    nrs = _SYSCALLS.get(platform.machine())
    if nrs is None:
        return errno.ENOSYS
    mask = _mask(nodes)
    if _libc().syscall(nrs[1], ctypes.c_int(mode), mask, ctypes.c_ulong(_MAX_NODE + 1)) != 0:
        return ctypes.get_errno()
    return 0


def mems_allowed(status_text: str) -> frozenset[int] | None:
    """``Mems_allowed_list`` of a ``/proc/<pid>/status`` text, None when absent or unreadable."""
    for line in status_text.splitlines():
        if line.startswith("Mems_allowed_list:"):
            out: set[int] = set()
            for item in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = item.strip().partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    return None
                out.update(range(int(lo), int(hi or lo) + 1))
            return frozenset(n for n in out if n < _MAX_NODE)
    return None


def pool_nodes(plan: dict) -> tuple[int | None, tuple[int, ...]]:
    """(node of the first pool's first CPU, every pool's nodes) from a plan's JSON."""
    npus = plan.get("npus") or {}
    nodes: set[int] = set()
    first = None
    for key in sorted(npus, key=lambda k: int(k) if str(k).isdigit() else 0):
        entry = npus[key] or {}
        here = [n for n in entry.get("numa_nodes") or () if isinstance(n, int) and 0 <= n < _MAX_NODE]
        nodes.update(here)
        if first is None and here:
            first = here[0]
    return first, tuple(sorted(nodes))


def prefer_nodes(plan: dict, *, status_text: str | None = None) -> str:
    """Set this task's memory policy to prefer the plan's pool nodes; the sentence saying what was done."""
    first, nodes = pool_nodes(plan)
    if not nodes:
        return "memory policy left alone: the plan names no NUMA node"
    if status_text is None:
        try:
            with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
                status_text = fh.read(65536)
        except OSError:
            status_text = ""
    allowed = mems_allowed(status_text)
    wanted = [n for n in nodes if allowed is None or n in allowed]
    if not wanted:
        return (f"memory policy left alone: the pool's NUMA nodes {','.join(map(str, nodes))} are outside this "
                f"task's Mems_allowed {','.join(map(str, sorted(allowed or ())))} (its cpuset.mems), never widened")
    mode = current_policy()
    if mode not in (MPOL_DEFAULT, None):
        return f"memory policy left alone: the task already has one of its own (mode {mode})"
    if len(wanted) > 1:
        err = _set(MPOL_PREFERRED_MANY, wanted)
        if err == 0:
            return f"memory preferred on NUMA nodes {','.join(map(str, wanted))} (MPOL_PREFERRED_MANY)"
        if err != errno.EINVAL:
            return f"memory policy left alone: set_mempolicy failed: {os.strerror(err)}"
    node = first if first in wanted else wanted[0]
    err = _set(MPOL_PREFERRED, [node])
    if err:
        return f"memory policy left alone: set_mempolicy failed: {os.strerror(err)}"
    why = " (this kernel has no MPOL_PREFERRED_MANY)" if len(wanted) > 1 else ""
    return f"memory preferred on NUMA node {node} (MPOL_PREFERRED){why}"
