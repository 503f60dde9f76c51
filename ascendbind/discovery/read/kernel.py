"""Kernel settings the daemon sizes itself by, read from ``/proc/sys``.

Shell side of discovery: these read the running kernel. ``parse_somaxconn`` is
the pure half, so a bad value is handled the same wherever the text came from.
"""

from __future__ import annotations

import os

__all__ = ["somaxconn", "parse_somaxconn", "SOMAXCONN_FLOOR", "SOMAXCONN_UNKNOWN"]

# listen() silently clamps a backlog to net.core.somaxconn; 128 was the kernel's
# default before 5.4, 4096 is today's: below the first nothing is sane, and when
# the file cannot be read the modern default is the best guess
SOMAXCONN_FLOOR = 128
SOMAXCONN_UNKNOWN = 4096


def parse_somaxconn(text: str | None) -> int:
    """The backlog cap from the file's text; the modern default when it is unreadable."""
    try:
        return max(SOMAXCONN_FLOOR, int((text or "").strip()))
    except ValueError:
        return SOMAXCONN_UNKNOWN


def somaxconn(proc_root: str = "/proc") -> int:
    """The kernel's cap on a listen backlog (``net.core.somaxconn``)."""
    try:
        with open(os.path.join(proc_root, "sys", "net", "core", "somaxconn"), encoding="ascii") as fh:
            return parse_somaxconn(fh.read(64))
    except (OSError, UnicodeDecodeError):
        return SOMAXCONN_UNKNOWN
