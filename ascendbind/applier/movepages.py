"""``move_pages(2)`` for another process, through ctypes: the one system call the memory
step makes to move pages (memory.py decides which). Each call raises the audit event
``ascendbind.move_pages`` (pid, pages, target node or -1 for a query) first: ctypes
raises none for a foreign call, and a root daemon's page moves should be visible to
an audit hook."""

from __future__ import annotations

import ctypes
import errno
import platform
import sys
from array import array

__all__ = ["MovePages", "MPOL_MF_MOVE", "UNREPORTED"]

MPOL_MF_MOVE = 1 << 1
# move_pages(2) by machine; asm-generic numbers it 239 (arm64, riscv64, loongarch64)
_SYSCALL = {"x86_64": 279, "aarch64": 239, "arm64": 239, "riscv64": 239, "loongarch64": 239,
            "ppc64le": 301, "ppc64": 301, "s390x": 310}
UNREPORTED = 1 << 30  # no node has this number


class MovePages:
    """``move_pages(2)`` for another process: ``query`` (where are these pages) and
    ``move`` (to one node); each returns the kernel's per-page status array."""

    def __init__(self, machine: str | None = None) -> None:
        self.nr = _SYSCALL.get(machine or platform.machine())
        self._libc = ctypes.CDLL(None, use_errno=True) if self.nr is not None else None

    @property
    def supported(self) -> bool:
        return self.nr is not None

    def _call(self, pid: int, addrs: array, nodes: array | None) -> tuple[int, array]:
        n = len(addrs)
        # a status the kernel did not write stays UNREPORTED: after a page fails to
        # migrate, move_pages returns the count not moved and writes no status for the
        # pages queued with it nor for the ones it did not try
        status = array("i", [UNREPORTED]) * n
        a = (ctypes.c_uint64 * n).from_buffer(addrs)
        s = (ctypes.c_int * n).from_buffer(status)
        nd = (ctypes.c_int * n).from_buffer(nodes) if nodes is not None else None
        sys.audit("ascendbind.move_pages", pid, n, nodes[0] if nodes else -1)
        rc = self._libc.syscall(ctypes.c_long(self.nr), ctypes.c_int(pid), ctypes.c_ulong(n), a, nd, s,
                                ctypes.c_int(MPOL_MF_MOVE))
        if rc < 0:
            err = ctypes.get_errno()
            raise OSError(err, errno.errorcode.get(err, str(err)))
        return rc, status

    def query(self, pid: int, addrs: list[int]) -> array:
        """The node of each page, or a negative errno (ENOENT: not present)."""
        return self._call(pid, array("Q", addrs), None)[1]

    def move(self, pid: int, addrs: list[int], node: int) -> tuple[int, array]:
        """Move each page to ``node``: (pages not migrated, statuses as the kernel wrote
        them; see ``_call``). OSError ENOMEM when the node has no room left."""
        return self._call(pid, array("Q", addrs), array("i", [node]) * len(addrs))
