"""What bound workers got of their CPUs, read from the kernel: per thread, per CPU, per pod.

Every reader answers None (or empty) for what is gone or unreadable: a thread
may exit between two reads, and that is news for the caller, not an error.

Per thread, two small files under the worker's task directory, opened
relative to one descriptor of that directory (``openat``: no path walk from
``/`` per file): ``schedstat`` for CPU time and run-queue delay, ``status`` for
the involuntary switches (measured: 9 and 18 us a read, the kernel formats
``status`` whole). Host-wide, ``/proc/stat`` and ``/proc/interrupts`` once per look,
whatever the number of workers. The pod: the worker's cgroup path names the pod
UID and the container ID where only the kubelet can have made it (kubelet.py's
``kubelet_place``), and the kubelet's log links under ``/var/log/containers`` (or
its pod directories under ``/var/log/pods``) name the pod, its namespace and the
container, read only from directories no one but root can write; nothing asks
the API server, nothing the worker can create or set is read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from typing import TypeVar

from ...values.digits import is_ascii_digits
from ..parse.kubelet import PodPlace, is_container_name, kubelet_place, link_is_pods, parse_container_log, \
    parse_pod_log_dir
from ..parse.procfs import parse_cgroup
from ..read.bounded import read_bounded
from ..parse.schedstat import ThreadSched, parse_cpu_busy, parse_interrupt_counts_by, parse_nonvoluntary, parse_schedstat, \
    parse_stat_cpu
from ...errors import ParseError

K = TypeVar("K")

__all__ = ["open_task_dir", "task_tids", "thread_sched", "thread_cpu", "cpu_busy_ns", "interrupt_counts", "pod_names",
           "LOG_DIR", "INTERRUPTS_LIMIT"]

LOG_DIR = "/var/log"
INTERRUPTS_LIMIT = 64 << 20  # a 640-CPU host with a few thousand IRQs prints some 20 MiB
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def open_task_dir(pid: int, proc_root: str = "/proc") -> int | None:
    """A descriptor of ``pid``'s task directory (the caller closes it); None when gone."""
    try:
        return os.open(f"{proc_root}/{pid}/task", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def task_tids(task_fd: int) -> list[int]:
    """The thread ids listed under an open task directory (empty once the process is gone)."""
    try:
        return [int(n) for n in os.listdir(task_fd) if is_ascii_digits(n)]
    except OSError:
        return []


def thread_sched(task_fd: int, tid: int) -> ThreadSched | None:
    """Thread ``tid``'s counters, read under an open task directory; None when it is gone
    (or its files do not parse)."""
    sched = read_bounded(f"{tid}/schedstat", 256, dir_fd=task_fd, single=True)
    status = read_bounded(f"{tid}/status", 16384, dir_fd=task_fd, single=True) if sched is not None else None
    if status is None:
        return None
    times = parse_schedstat(sched)
    nonvoluntary = parse_nonvoluntary(status)
    if times is None or nonvoluntary is None:
        return None
    return ThreadSched(times[0], times[1], nonvoluntary)


def thread_cpu(task_fd: int, tid: int) -> int | None:
    """The CPU thread ``tid`` last ran on (its ``stat``, read under an open task directory);
    None when it is gone."""
    text = read_bounded(f"{tid}/stat", 2048, dir_fd=task_fd, single=True)
    return None if text is None else parse_stat_cpu(text)


def cpu_busy_ns(cpus, proc_root: str = "/proc") -> dict[int, int] | None:
    """CPU -> the time it was busy since boot (ns, at the tick's resolution), for ``cpus``."""
    text = read_bounded(f"{proc_root}/stat", 1 << 20)
    if text is None:
        return None
    return {cpu: ticks * 1_000_000_000 // _CLK_TCK for cpu, ticks in parse_cpu_busy(text, cpus).items()}


def interrupt_counts(groups: Mapping[K, Iterable[int]], proc_root: str = "/proc") -> dict[K, dict[int, int]] | None:
    """Per group of CPUs, IRQ -> how often it fired on them since boot (numbered IRQs only),
    from one read of ``/proc/interrupts``."""
    text = read_bounded(f"{proc_root}/interrupts", INTERRUPTS_LIMIT)
    return None if text is None else parse_interrupt_counts_by(text, groups)


def _kubelet_dir(path: str) -> bool:
    """Whether ``path`` is a directory only root can change (the kubelet's log directories
    are root's, 0755): names in a directory anyone else may write name nothing."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022


def _place(pid: int, proc_root: str) -> PodPlace | None:
    """The kubelet's pod and container of ``pid`` from its cgroup paths (kubelet.py's
    kubelet_place), None when it is in none or its hierarchies disagree on the pod."""
    text = read_bounded(f"{proc_root}/{pid}/cgroup", 1 << 16)
    if text is None:
        return None
    try:
        entries = parse_cgroup(text)
    except ParseError:
        return None
    places = {p for p in (kubelet_place(e.path) for e in entries) if p.pod_uid is not None}
    if len({p.pod_uid for p in places}) != 1:
        return None  # in no pod, or (v1) in two: a host that says two things says nothing
    containers = {p.container_id for p in places} - {None}
    return PodPlace(next(iter(places)).pod_uid, containers.pop() if len(containers) == 1 else None)


def _container_link(log_dir: str, place: PodPlace) -> dict[str, str] | None:
    """The pod's names from the kubelet's link to the container's log: its name carries the
    container ID, its target the pod UID (link_is_pods)."""
    if place.container_id is None or not _kubelet_dir(f"{log_dir}/containers"):
        return None
    suffix = f"-{place.container_id}.log"
    try:
        with os.scandir(f"{log_dir}/containers") as it:
            for entry in it:
                named = parse_container_log(entry.name) if entry.name.endswith(suffix) else None
                if named is None:
                    continue
                pod, ns, container, _ = named
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    continue
                if link_is_pods(target, ns, pod, place.pod_uid, container):
                    return {"namespace": ns, "pod_name": pod, "container_name": container}
    except OSError:
        pass
    return None


def _pod_dir(log_dir: str, place: PodPlace) -> dict[str, str] | None:
    """The pod's names from its log directory, ``<namespace>_<pod>_<uid>``; the container
    is named only when the pod has exactly one."""
    if not _kubelet_dir(f"{log_dir}/pods"):
        return None
    try:
        with os.scandir(f"{log_dir}/pods") as it:
            for entry in it:
                named = parse_pod_log_dir(entry.name)
                if named is None or named[2] != place.pod_uid or not entry.is_dir(follow_symlinks=False):
                    continue
                try:
                    names = [d for d in os.listdir(entry.path) if not d.startswith(".")]
                except OSError:
                    names = []
                one = names[0] if len(names) == 1 and is_container_name(names[0]) else ""
                return {"namespace": named[0], "pod_name": named[1], "container_name": one}
    except OSError:
        pass
    return None


def pod_names(pid: int, proc_root: str = "/proc", log_dir: str = LOG_DIR) -> dict[str, str]:
    """``namespace``, ``pod_name``, ``container_name`` of the pod ``pid`` runs in, as far
    as the host tells: empty values for a process outside a pod the kubelet made, or where
    the kubelet's log directories are not there to name it (a pod UID alone names nothing
    an operator joins on). Only what root made is read: the cgroup path where only the
    kubelet can have made it, and the names in the kubelet's root-owned log directories."""
    place = _place(pid, proc_root)
    if place is None:
        return {"namespace": "", "pod_name": "", "container_name": ""}
    return (_container_link(log_dir, place) or _pod_dir(log_dir, place)
            or {"namespace": "", "pod_name": "", "container_name": ""})
