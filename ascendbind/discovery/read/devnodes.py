"""The character devices of one major in a directory of the live host, by lstat.

Used on ``/proc/<pid>/root/dev``: the worker's own ``/dev`` seen through its root,
which its owner controls. So the directory is opened without following a link
(a ``/dev`` that is a symlink is not read), no entry is followed, and a directory
holding more than ``DEV_ENTRIES_LIMIT`` entries is not listed at all: a container
holds tens, and its owner must not make root stat millions.
"""

from __future__ import annotations

import os
import stat

from ...values.targeting import DeviceNode

__all__ = ["scan_char_devices", "DEV_ENTRIES_LIMIT"]

DEV_ENTRIES_LIMIT = 4096


def scan_char_devices(path: str, major: int) -> list[DeviceNode] | None:
    """Nodes of ``major`` under ``path`` sorted by minor; None when the directory cannot be
    opened, is a link, or is too large to list."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    out: list[DeviceNode] = []
    try:
        with os.scandir(fd) as entries:
            for count, entry in enumerate(entries):
                if count >= DEV_ENTRIES_LIMIT:
                    return None
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == major:
                    out.append(DeviceNode(entry.name, major, os.minor(st.st_rdev)))
    except OSError:
        return None
    finally:
        os.close(fd)
    return sorted(out, key=lambda n: (n.minor, n.name))
