"""A worker's cgroup v2 files when its cgroup lies outside the reader's cgroup namespace. Pure.

``/proc/<pid>/cgroup`` prints a cgroup v2 path relative to the *reader's*
cgroup namespace. A daemon in a container with a cgroup namespace of its own
(the default of containerd and CRI-O on cgroup v2) reads a worker in another pod
as ``0::/../../kubepods.slice/.../cri-containerd-<id>.scope``: a path that climbs
out of every cgroup tree the daemon has mounted, so the worker's
``cpuset.cpus.effective`` cannot be found under the daemon's ``/sys/fs/cgroup``.

The worker's own mount namespace has one: its runtime mounted cgroup2 at the
root of the worker's cgroup namespace. ``/proc/<pid>/mountinfo`` names each
mount's root as a cgroup path, and the kernel prints that path relative to the
reader's cgroup namespace too (``cgroup_show_path``). So both paths are in the
daemon's terms, and a cgroup2 mount of the worker whose root is the worker's
cgroup path, or a prefix of it, holds the worker's cgroup at the remainder:
``/proc/<pid>/root/<mount point>/<remainder>/cpuset.cpus.effective``. The
match is made on the kernel's words (mountinfo), never on what the worker's
files say; the file is then read through its root, on a reader with a deadline,
since the worker's mount namespace is the worker's to build.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CgroupMount", "cgroup2_mounts", "locate_cgroup", "MOUNTINFO_LIMIT"]

# a container's mountinfo is a few KiB; a host with thousands of mounts, a few hundred
MOUNTINFO_LIMIT = 1 << 20


class CgroupMount(NamedTuple):
    root: str  # the cgroup at the mount's root, in the reader's cgroup namespace
    mount_point: str  # where it is mounted, in the process's mount namespace


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as three octal digits
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _plain(path: str) -> bool:
    return path.startswith("/") and not any(p in (".", "..") for p in path.split("/")[1:] if p)


def cgroup2_mounts(text: str) -> list[CgroupMount]:
    """The cgroup2 mounts of a ``/proc/<pid>/mountinfo`` text (lines it cannot read are skipped)."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep or right.split(" ", 1)[0] != "cgroup2":
            continue
        fields = left.split(" ")
        if len(fields) < 5:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if root.startswith("/") and _plain(point):
            out.append(CgroupMount(root.rstrip("/") or "/", point.rstrip("/") or "/"))
    return out


def locate_cgroup(path: str, mounts: list[CgroupMount]) -> tuple[str, str] | None:
    """(mount point, remainder) of the mount whose root is ``path`` or its nearest ancestor,
    None when no cgroup2 mount holds it. The remainder is "" or "/a/b", free of ``..``."""
    path = path.rstrip("/") or "/"
    best = None
    for m in mounts:
        if m.root == path or path.startswith(m.root.rstrip("/") + "/"):
            rest = path[len(m.root):] if m.root != "/" else path
            rest = "" if rest == "/" else rest
            if rest and not _plain(rest):
                continue
            if best is None or len(m.root) > len(best[0].root):
                best = (m, rest)
    return None if best is None else (best[0].mount_point, best[1])
