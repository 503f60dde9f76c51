"""What bound workers got of their CPUs, read from the kernel: per thread, per CPU, per pod.

Every reader answers None (or empty) for what is gone or unreadable: a thread
may exit between two reads, and that is news for the caller, not an error.

Per thread, two small files under the worker's task directory, opened
relative to one descriptor of that directory (``openat``: no path walk from
``/`` per file): ``schedstat`` for CPU time and run-queue delay, ``status`` for
the involuntary switches (measured: 9 and 18 us a read, the kernel formats
``status`` whole). Host-wide, ``/proc/stat`` and ``/proc/interrupts`` once per look,
whatever the number of workers. The pod: the worker's cgroup path names the pod
UID and the container ID (kubelet's naming), and the kubelet's log links under
``/var/log/containers`` name the pod, its namespace and the container; nothing
asks the API server.
"""

from __future__ import annotations

import os

from ...values.digits import is_ascii_digits
from ..parse.procfs import parse_cgroup
from ..parse.schedstat import (ThreadSched, parse_container_log, parse_cpu_busy, parse_interrupt_counts,
                        parse_nonvoluntary, parse_schedstat, pod_of_cgroup)
from ...errors import ParseError

__all__ = ["open_task_dir", "task_tids", "thread_sched", "cpu_busy_ns", "interrupt_counts", "pod_names",
           "LOG_DIR", "INTERRUPTS_LIMIT"]

LOG_DIR = "/var/log"
INTERRUPTS_LIMIT = 64 << 20  # a 640-CPU host with a few thousand IRQs prints some 20 MiB
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _read(name: str, limit: int, dir_fd: int | None = None) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        chunks, size = [], 0
        while size < limit:
            chunk = os.read(fd, min(1 << 20, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


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


def _read_once(name: str, limit: int, dir_fd: int) -> str | None:
    """One ``read`` of a small file the kernel prints whole on the first (a thread's
    ``schedstat``, ``status``): the hot path of a scrape, no loop, no buffer list."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def thread_sched(task_fd: int, tid: int) -> ThreadSched | None:
    """Thread ``tid``'s counters, read under an open task directory; None when it is gone
    (or its files do not parse)."""
    sched = _read_once(f"{tid}/schedstat", 256, task_fd)
    status = _read_once(f"{tid}/status", 16384, task_fd) if sched is not None else None
    if status is None:
        return None
    times = parse_schedstat(sched)
    nonvoluntary = parse_nonvoluntary(status)
    if times is None or nonvoluntary is None:
        return None
    return ThreadSched(times[0], times[1], nonvoluntary)


def cpu_busy_ns(cpus, proc_root: str = "/proc") -> dict[int, int] | None:
    """CPU -> the time it was busy since boot (ns, at the tick's resolution), for ``cpus``."""
    text = _read(f"{proc_root}/stat", 1 << 20)
    if text is None:
        return None
    return {cpu: ticks * 1_000_000_000 // _CLK_TCK for cpu, ticks in parse_cpu_busy(text, cpus).items()}


def interrupt_counts(cpus, proc_root: str = "/proc") -> dict[int, int] | None:
    """IRQ -> how often it fired on ``cpus`` since boot (numbered IRQs only)."""
    text = _read(f"{proc_root}/interrupts", INTERRUPTS_LIMIT)
    return None if text is None else parse_interrupt_counts(text, cpus)


def pod_names(pid: int, proc_root: str = "/proc", log_dir: str = LOG_DIR) -> dict[str, str]:
    """``namespace``, ``pod_name``, ``container_name`` of the pod ``pid`` runs in, as far
    as the host tells: empty values for a process outside a pod, or where the kubelet's
    log links are not there to name it (a pod UID alone names nothing an operator joins on)."""
    out = {"namespace": "", "pod_name": "", "container_name": ""}
    text = _read(f"{proc_root}/{pid}/cgroup", 1 << 16)
    if text is None:
        return out
    try:
        entries = parse_cgroup(text)
    except ParseError:
        return out
    uid = container = None
    for e in entries:
        uid, container = pod_of_cgroup(e.path)
        if uid is not None:
            break
    if uid is None:
        return out
    if container is not None:
        suffix = f"-{container}.log"
        try:
            with os.scandir(f"{log_dir}/containers") as it:
                for entry in it:
                    if entry.name.endswith(suffix):
                        named = parse_container_log(entry.name)
                        if named is not None:
                            return {"namespace": named[1], "pod_name": named[0], "container_name": named[2]}
        except OSError:
            pass
    # /var/log/pods/<namespace>_<pod>_<uid>/<container>/: the pod's names even without the
    # container's link; the container is named only when the pod has exactly one
    try:
        with os.scandir(f"{log_dir}/pods") as it:
            for entry in it:
                ns, _, rest = entry.name.partition("_")
                pod, _, pod_uid = rest.rpartition("_")
                if pod_uid == uid and ns and pod:
                    out.update(namespace=ns, pod_name=pod)
                    try:
                        names = [d for d in os.listdir(entry.path) if not d.startswith(".")]
                    except OSError:
                        names = []
                    if len(names) == 1:
                        out["container_name"] = names[0]
                    break
    except OSError:
        pass
    return out
