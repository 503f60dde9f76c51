"""Give the calling OS thread its Python thread's name, so ``top -H``, ``ps -L``
and ``/proc/<pid>/task/<tid>/comm`` tell the daemon's threads apart.

CPython (before 3.14) leaves every thread named after the process: an operator
looking at which thread burns CPU, and the idle benchmark that charges CPU time
per thread, would see a dozen identical names. ``prctl(PR_SET_NAME)`` names the
calling thread only; the kernel keeps 15 bytes of it.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["name_os_thread"]

_PR_SET_NAME = 15
_libc = None


def name_os_thread(name: str | None = None) -> None:
    """Name the calling thread (default: its ``threading`` name). Best effort: a libc
    without prctl leaves the name as it was."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        text = (name or threading.current_thread().name).encode("ascii", "replace")[:15]
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0)
    except (OSError, AttributeError):
        pass
