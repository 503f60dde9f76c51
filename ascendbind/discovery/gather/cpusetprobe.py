"""Whether a bound worker's cpuset, or kubelet's CPU manager checkpoint, changed: one read a pass.

A cpuset can change under a bound worker: kubelet's CPU manager gives a pod other
CPUs (a resize, a pod update), an operator writes ``cpuset.cpus``, a CPU goes
offline. The kernel then narrows every task of the cgroup to the new CPUs at once:
a thread whose mask (the one ascendbind set) still meets the new set keeps that
part, any other gets the whole new set; when the set widens again, the kernel
gives each thread back what it last asked for inside it (``sched_setaffinity``
keeps the requested mask beside the effective one). So a changed cpuset shows as
threads on CPUs outside their plan, or, when it widens, as nothing at all.

``CpusetProbe`` keeps the worker's effective-CPUs file (``cpuset.effective_cpus``
on v1, ``cpuset.cpus.effective`` on v2) open and reads it with one ``pread`` at
offset 0, which makes the kernel print it afresh: the cost of a
``sched_getaffinity``. Its text is parsed only when it differs from the last
read. The file follows its cgroup, not the worker: a worker moved to another
cgroup is found by opening the probe again (``open_cpuset_probe``), which the
reconcile loop does when a thread is seen outside its plan. Once the cgroup is
removed the read fails (ENODEV) and the probe says None.

``checkpoint_stamp``: kubelet rewrites its checkpoint by renaming a new file over
it, so one ``stat`` (inode, size, modification time) says whether it changed.
"""

from __future__ import annotations

import os

from ...errors import AscendbindError, ParseError
from ..parse.kubelet import CHECKPOINT_PATH
from ..parse.sysfs import parse_cpulist_file
from ..read.sources import HostSource
from .process import observe_process

__all__ = ["CpusetProbe", "open_cpuset_probe", "checkpoint_stamp"]

# a cpulist of a 4096-CPU host written the longest way ("0,2,4,...") is under 20 KiB
_READ = 1 << 15


class CpusetProbe:
    """An open cgroup effective-CPUs file; ``cpus()`` reads it again."""

    __slots__ = ("fd", "path", "_text", "_cpus")

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self._text: bytes | None = None
        self._cpus: frozenset[int] | None = None

    def cpus(self) -> frozenset[int] | None:
        """The cgroup's CPUs now; None when the file cannot be read (the cgroup was
        removed) or does not hold a non-empty CPU list."""
        if self.fd < 0:
            return None
        try:
            text = os.pread(self.fd, _READ, 0)
        except OSError:
            return None
        if text != self._text:
            self._text = text
            try:
                self._cpus = parse_cpulist_file(text.decode("ascii", "replace"), self.path) or None
            except ParseError:
                self._cpus = None
        return self._cpus

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_cpuset_probe(source: HostSource, pid: int) -> CpusetProbe | None:
    """A probe of the cpuset ``pid`` lives in now (its ``/proc/<pid>/cgroup`` read once),
    or None: no live host to read, no cpuset controller, a path that climbs out of the
    hierarchy, the file unreadable, or the process gone."""
    host_path = getattr(source, "host_path", None)
    if host_path is None:
        return None
    try:
        view = observe_process(source, pid, tasks=False, environ=False)
    except AscendbindError:
        return None
    cs = view.cpuset
    if cs is None or cs.file is None or cs.text is None:
        return None
    try:
        fd = os.open(host_path(cs.file), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    return CpusetProbe(fd, cs.file)


def checkpoint_stamp(source: HostSource) -> tuple[int, int, int] | None:
    """(inode, size, mtime in ns) of kubelet's CPU manager checkpoint; None when absent."""
    host_path = getattr(source, "host_path", None)
    if host_path is None:
        return None
    try:
        st = os.stat(host_path(CHECKPOINT_PATH))
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
