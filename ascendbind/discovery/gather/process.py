"""One observation of a process: identity, status, cpuset, environment and tasks, read once.

A request (bind, plan, release) reads its target once, into a ``ProcessView``,
and hands that value to authorization, the identity check, the worker's facts,
the applier and the held record; nobody reads the same files again to
"refresh" them.

On the live host the files are read through one open ``/proc/<pid>``
directory: it stands for the task it was opened on, and once that task is
reaped every read through it fails (ESRCH) instead of describing a process that
reused the number. So every file of one view describes one process. A snapshot
(or any HostSource without ``open_process``) is read path by path; its stat is
read first and again last, and a start time that changed means the pid was
recycled in between.

Also here, for the applier and the daemon, the small reads they need between
views: the task list and a thread's ``comm`` (the applier's re-list of threads
born during a bind), the parent of a pid (authorization's ancestry walk), a
pid's (state, start time) and this process's effective capabilities.
"""

from __future__ import annotations

import os
from itertools import starmap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ...values.digits import is_ascii_digits
from ...errors import ParseError, ProcessGone, UsageError
from ...values.frozen import frozen_map
from ...values.model import ProcessIdentity, ThreadInfo
from ..parse.procfs import (ENVIRON_LIMIT, CgroupEntry, ProcStat, ProcStatus, cpuset_cgroup, cut_environ, parse_cgroup,
                     parse_environ, parse_stat, parse_status)
from ..parse.mountinfo import MOUNTINFO_LIMIT, cgroup2_mounts, locate_cgroup
from ..read.pin import ProcessPin, pin_observed
from ..read.bounded import read_bounded, task_affinity
from ..read.procdir import ProcDir
from ..read.sources import HostSource, path_proc_dir

__all__ = [
    "stat_at",
    "ProcessView",
    "TaskView",
    "CpusetView",
    "observe_process",
    "check_same_process",
    "identity_of",
    "read_identity",
    "stat_of",
    "exiting",
    "list_tasks",
    "task_comm",
    "read_comm",
    "new_tasks",
    "thread_masks",
    "parent_of",
    "status_field",
]

# a comm is at most 15 bytes plus the newline
_COMM_BYTES = 64


class TaskView(NamedTuple):
    """One thread as seen in the observation; ``mask`` only when asked for (live host).
    A tuple, not a dataclass: a bind makes one per thread, on its hot path."""

    tid: int
    comm: str
    mask: frozenset[int] | None = None


@dataclass(frozen=True)
class CpusetView:
    """The process's cgroup cpuset: hierarchy version, cgroup path, and the effective
    cpus file's path and text (None when unreadable, or the path climbs out with ``..``)."""

    version: str
    path: str
    file: str | None = None
    text: str | None = None


@dataclass(frozen=True)
class ProcessView:
    """One observation of a process. ``identity`` is None only when a snapshot recorded
    no ``stat`` (the live host always has one). ``key`` is the /proc name it was read
    under: the pid, or ``self`` for a snapshot of the recording process."""

    key: str
    status: ProcStatus
    identity: ProcessIdentity | None
    cpuset: CpusetView | None
    environ: Mapping[str, str] | None
    tasks: tuple[TaskView, ...]
    warnings: tuple[str, ...] = field(default=())
    # every line of /proc/<pid>/cgroup (None when unreadable): the devices controller's path
    cgroup: tuple[CgroupEntry, ...] | None = None
    # the process held by its pidfd and open directory (observe_process(pin=True)), else None
    pin: ProcessPin | None = field(default=None, compare=False, repr=False)

    @property
    def pid(self) -> int:
        if self.identity is not None:
            return self.identity.pid
        if is_ascii_digits(self.key):
            return int(self.key)
        if self.status.tgid is None:
            raise ParseError(f"/proc/{self.key}/status", "no Tgid line")
        return self.status.tgid

    @property
    def start_time(self) -> int | None:
        return None if self.identity is None else self.identity.start_time

    @property
    def threads(self) -> tuple[ThreadInfo, ...]:
        return tuple(ThreadInfo(t.tid, t.comm) for t in self.tasks)


def _identity(pid: int, stat_text: str | None, status: ProcStatus | None, where: str) -> ProcessIdentity | None:
    if stat_text is None:
        return None
    try:
        st = parse_stat(stat_text, where)
    except ParseError:
        return None
    return ProcessIdentity(
        pid=pid,
        start_time=st.start_time,
        tgid=status.tgid if status is not None and status.tgid is not None else pid,
        ppid=st.ppid,
        state=st.state,
        is_kthread=st.is_kthread,
        uids=status.uids if status is not None else (),
        comm=st.comm,
    )


def _tasks(d: ProcDir, masks: bool) -> tuple[TaskView, ...]:
    fast = getattr(d, "task_comms", None)
    if fast is not None and not masks:
        listed = fast()
        if not listed:
            return ()
        listed.sort()  # plain (tid, comm) pairs sort faster than the named tuples made of them
        return tuple(starmap(TaskView, listed))
    out: list[TaskView] = []
    read = getattr(d, "read_small", d.read)
    getaff = task_affinity
    for name in d.listdir("task") or ():
        if not name.isdigit():
            continue
        comm = read(f"task/{name}/comm", _COMM_BYTES)
        if comm is None:
            continue  # the thread exited while we listed
        tid = int(name)
        mask = None
        if masks:
            try:
                mask = frozenset(getaff(tid))
            except OSError:
                continue
        out.append(TaskView(tid, comm.rstrip("\n"), mask))
    out.sort()
    return tuple(out)


def _cpuset(source: HostSource, cgroup: tuple[CgroupEntry, ...] | None) -> CpusetView | None:
    where = cpuset_cgroup(cgroup) if cgroup is not None else None
    if where is None:
        return None
    version, path = where
    rel = path.rstrip("/")
    if ".." in rel.split("/"):
        return CpusetView(version, path)
    if version == "v1":
        file = f"/sys/fs/cgroup/cpuset{rel}/cpuset.effective_cpus"
        return CpusetView(version, path, file, source.read(file))
    # v2: a cgroup whose parent does not enable the cpuset controller has no cpuset files
    # and runs on its nearest ancestor's effective CPUs (the root's: every online CPU)
    while True:
        file = f"/sys/fs/cgroup{rel}/cpuset.cpus.effective"
        text = source.read(file)
        if text is not None or not rel:
            return CpusetView(version, path, file, text)
        rel = rel.rpartition("/")[0]


def _climbed_cpuset(d: ProcDir, key: str, cg_text: str | None) -> CpusetView | None:
    """A cgroup v2 cpuset outside this process's cgroup namespace (``0::/../...``), read through
    the worker's own cgroup2 mount (mountinfo.py); None for any other cgroup, or when no mount
    of the worker's holds it."""
    if cg_text is None or "/.." not in cg_text:
        return None
    try:
        where = cpuset_cgroup(parse_cgroup(cg_text, f"/proc/{key}/cgroup"))
    except ParseError:
        return None  # reported when the text is parsed for the view
    if where is None or where[0] != "v2" or ".." not in where[1].split("/"):
        return None
    mounts = d.read("mountinfo", MOUNTINFO_LIMIT)
    found = locate_cgroup(where[1], cgroup2_mounts(mounts)) if mounts and len(mounts) <= MOUNTINFO_LIMIT else None
    if found is None:
        return CpusetView("v2", where[1])
    point, rest = found
    # like the host's tree: a cgroup without the cpuset controller runs on its parent's CPUs
    while True:
        name = f"root{point.rstrip('/')}{rest}/cpuset.cpus.effective"
        text = d.read(name, 4096)
        if text is not None or not rest:
            return CpusetView("v2", where[1], f"/proc/{key}/{name}", text)
        rest = rest.rpartition("/")[0]


def observe_process(source: HostSource, pid: int | None, *, tasks: bool = True, masks: bool = False,
                    environ: bool = True, vet: Callable[[ProcessIdentity], None] | None = None,
                    pin: bool = False) -> ProcessView:
    """One observation of ``pid`` (None: ``/proc/self``, the snapshot's recording process).

    ProcessGone (``pid_gone``) when there is no such process, ParseError when its
    status is malformed, ProcessGone (``pid_recycled``) when a path-by-path source
    saw the start time change while reading. ``masks`` adds each thread's current
    mask (live host only); ``tasks``/``environ`` False skip what a caller does not need.
    ``vet`` is called with the identity as soon as stat and status are read, before
    anything else is: a request refused there reads no environment and no threads.

    The environment: its complete entries within ``ENVIRON_LIMIT`` bytes (a warning when
    cut), a key's first entry winning as in getenv; DiscoveryError ``read_timeout`` when
    it does not answer in time (it is copied out of the worker's memory: deadline.py).
    ``pin``: on the live host, the view's ``pin`` holds the process (pin.py) from
    before its stat is read, and keeps its directory open; the caller closes it.
    """
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0):
        raise UsageError(f"pid must be a positive integer, got {pid!r}")
    key = "self" if pid is None else str(pid)
    opener = getattr(source, "open_process", None)
    d = opener(key) if opener is not None else path_proc_dir(source, key)
    if d is None:
        raise ProcessGone(f"no process {key}: /proc/{key} is absent", code="pid_gone")
    held = pin_observed(source, d, pid) if pin else None  # before stat: the reads below prove it
    try:
        stat_text, status, real, identity = _vetted_identity(d, key, pid, vet)
        cg_text = d.read("cgroup")
        climbed = _climbed_cpuset(d, key, cg_text)
        env_text = d.read("environ", ENVIRON_LIMIT) if environ else None
        task_views = _tasks(d, masks) if tasks else ()
        last_stat = d.read("stat") if not d.pinned and stat_text is not None else stat_text
    except BaseException:
        if held is not None:
            held.close()
        raise
    finally:
        if held is None:
            d.close()
    try:
        if identity is not None and last_stat != stat_text:
            _same_start(identity, _identity(real, last_stat, status, f"/proc/{key}/stat"))
        cgroup = parse_cgroup(cg_text, f"/proc/{key}/cgroup") if cg_text is not None else None
        env, cut = cut_environ(env_text) if env_text is not None else (None, None)
    except BaseException:
        if held is not None:
            held.close()
        raise
    return ProcessView(
        key=key,
        status=status,
        identity=identity,
        cpuset=climbed or _cpuset(source, cgroup),
        environ=frozen_map(parse_environ(env)) if env is not None else None,
        tasks=task_views,
        warnings=(f"/proc/{key}/{cut}",) if cut is not None else (),
        cgroup=cgroup,
        pin=held,
    )


def _vetted_identity(d: ProcDir, key: str, pid: int | None, vet: Callable[[ProcessIdentity], None] | None,
                     ) -> tuple[str | None, ProcStatus, int, ProcessIdentity | None]:
    """(stat text, status, pid, identity) of the process ``d`` was opened on, once ``vet``
    (when given) has let it through; ProcessGone/ParseError as ``observe_process`` says."""
    stat_text = d.read("stat")
    status_text = d.read("status")
    if status_text is None:
        raise ProcessGone(f"no process {key}: /proc/{key}/status is absent", code="pid_gone")
    status = parse_status(status_text, f"/proc/{key}/status")
    d.owner = status.uids[0] if status.uids else None
    real = pid if pid is not None else status.tgid
    if real is None:
        raise ParseError(f"/proc/{key}/status", "no Tgid line")
    identity = _identity(real, stat_text, status, f"/proc/{key}/stat")
    if vet is not None:
        if identity is None:
            raise ProcessGone(f"process {real} has no readable stat", code="pid_gone")
        vet(identity)
    return stat_text, status, real, identity


def _same_start(first: ProcessIdentity, again: ProcessIdentity | None) -> None:
    """Raises ProcessGone when the stat read last shows the process gone, or another one
    (a different start time) under its pid: a path-by-path source saw it change."""
    if again is None:
        raise ProcessGone(f"process {first.pid} exited while it was being read", code="pid_gone")
    if again.start_time != first.start_time:
        raise ProcessGone(f"pid {first.pid} was recycled while it was being read: started at tick "
                          f"{again.start_time}, not {first.start_time}", code="pid_recycled")


def check_same_process(view: ProcessView, identity: ProcessIdentity) -> None:
    """ProcessGone unless ``view`` is of the process ``identity`` names (``pid_gone`` when the
    view has no start time, ``pid_recycled`` when it has another one)."""
    if view.identity is None:
        raise ProcessGone(f"process {view.pid} exited while it was being read", code="pid_gone")
    if identity.pid != view.pid or view.start_time != identity.start_time:
        raise ProcessGone(
            f"pid {view.pid} was recycled while it was being read: started at tick {view.start_time}, "
            f"not {identity.start_time}",
            code="pid_recycled",
        )


def identity_of(source: HostSource, pid: int) -> ProcessIdentity | None:
    """``pid``'s identity (stat, and status when there is one, through one directory), or
    None when it is absent or either file is malformed. Without a status the uids are empty."""
    opener = getattr(source, "open_process", None)
    d = opener(str(pid)) if opener is not None else path_proc_dir(source, str(pid))
    if d is None:
        return None
    try:
        stat_text, status_text = d.read("stat"), d.read("status")
    finally:
        d.close()
    try:
        status = parse_status(status_text, f"/proc/{pid}/status") if status_text else None
    except ParseError:
        return None
    return _identity(pid, stat_text, status, f"/proc/{pid}/stat")


# ------------------------------------------------------------ the small reads, by proc_root

def read_identity(pid: int, proc_root: str = "/proc") -> ProcessIdentity | None:
    """``pid``'s identity from one read of its stat and status, or None when it is absent."""
    from ..read.sources import LiveHost

    return identity_of(LiveHost(proc_root=proc_root), pid)


def _stat(pid: int, proc_root: str) -> ProcStat | None:
    return stat_at(f"{proc_root}/{pid}/stat")


def stat_at(path: str) -> ProcStat | None:
    """The process or thread ``stat`` file at ``path``, parsed; None when it is gone or malformed."""
    text = read_bounded(path, 4096, single=True)
    if text is None:
        return None
    try:
        return parse_stat(text, path)
    except ParseError:
        return None


def stat_of(pid: int, proc_root: str = "/proc") -> tuple[str, int] | None:
    """(state letter, start time) from ``/proc/<pid>/stat``, or None when the pid is absent."""
    st = _stat(pid, proc_root)
    return None if st is None else (st.state, st.start_time)


def exiting(pid: int, proc_root: str = "/proc") -> bool:
    """Whether ``pid`` is gone or on its way out (``PF_EXITING``): a process killed while
    its memory is torn down still reads as running until it is a zombie, but has no
    address space left to act on."""
    st = _stat(pid, proc_root)
    return st is None or st.is_exiting or st.state in ("Z", "X", "x")


def status_field(pid: int | str, name: str, proc_root: str = "/proc") -> str | None:
    """One field of ``/proc/<pid>/status`` (``pid`` may be ``self``), or None."""
    text = read_bounded(f"{proc_root}/{pid}/status", 16384, single=True)
    if text is None:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


def parent_of(pid: int, proc_root: str = "/proc") -> int | None:
    """``pid``'s parent (PPid), or None when it is gone or unreadable."""
    value = status_field(pid, "PPid", proc_root)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def read_comm(path: str) -> str | None:
    """A thread's ``comm`` at ``path`` (one read, at most 64 bytes); None once the thread is gone."""
    text = read_bounded(path, _COMM_BYTES, single=True)
    return None if text is None else text.rstrip("\n")


def task_comm(pid: int, tid: int | str, proc_root: str = "/proc") -> str | None:
    """The ``comm`` of thread ``tid`` of ``pid``, or None once it is gone."""
    return read_comm(f"{proc_root}/{pid}/task/{tid}/comm")


def list_tasks(pid: int, proc_root: str = "/proc") -> list[str] | None:
    """The names under ``/proc/<pid>/task`` (unsorted), or None when the process is gone."""
    try:
        return os.listdir(f"{proc_root}/{pid}/task")
    except OSError:
        return None


def new_tasks(pid: int, seen: Iterable[str] | set[str], proc_root: str = "/proc") -> list[tuple[str, str | None]] | None:
    """(tid, comm) of the threads of ``pid`` not in ``seen``: one listing, one comm read per
    new thread (comm None: the thread exited before it was read). None when the process is
    gone. One plain loop: the applier's first pass without an observation lists them all."""
    task_dir = f"{proc_root}/{pid}/task"
    try:
        names = os.listdir(task_dir)
    except OSError:
        return None
    seen = seen if isinstance(seen, set) else set(seen)
    out: list[tuple[str, str | None]] = []
    flags = os.O_RDONLY | os.O_CLOEXEC
    open_, read, close = os.open, os.read, os.close
    for name in names:
        if name in seen:
            continue
        comm = None
        try:
            fd = open_(f"{task_dir}/{name}/comm", flags)
        except OSError:
            out.append((name, None))
            continue
        try:
            comm = read(fd, _COMM_BYTES).decode("utf-8", "replace").rstrip("\n")
        except OSError:
            comm = None
        finally:
            close(fd)
        out.append((name, comm))
    return out


def thread_masks(pid: int, *, proc_root: str = "/proc") -> dict[int, tuple[str, frozenset[int]]]:
    """tid -> (comm, current CPU mask) for every live thread of ``pid`` ({} when gone)."""
    out: dict[int, tuple[str, frozenset[int]]] = {}
    for name in list_tasks(pid, proc_root) or ():
        comm = task_comm(pid, name, proc_root)
        if comm is None:
            continue
        tid = int(name)
        try:
            out[tid] = (comm, frozenset(task_affinity(tid)))
        except OSError:
            continue
    return out
