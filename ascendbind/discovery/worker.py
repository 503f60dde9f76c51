"""Per-request facts of one worker process, through a HostSource.

``discover_worker`` is cheap by design (a daemon calls it for every bind): a
few small /proc files, one ``comm`` per thread, the cgroup cpuset file;
``ps -Te`` only with ``want_uvb`` (Ascend 950).

``read_numa_residency`` is not: the kernel walks every page table of the
process to print ``numa_maps`` (about a second for a 100 GiB heap of 4 KiB
pages), so it never runs on the bind path, only in the daemon's rate-limited
locality check and in ``status --memory``.
"""

from __future__ import annotations

from ..config import Config
from ..cpulist import format_cpulist
from ..errors import DiscoveryError, ParseError, ProcessGone, UsageError
from ..model import ProcessIdentity, ThreadInfo, WorkerFacts, frozen_map
from .numa_maps import NumaResidency, parse_numa_maps
from .procfs import cpuset_cgroup, parse_cgroup, parse_environ, parse_ps_te, parse_stat_start_time, parse_status
from .sources import HostSource
from .sysfs import parse_cpulist_file

__all__ = ["discover_worker", "read_numa_residency", "UVB_COMM_PREFIX", "NUMA_MAPS_LIMIT"]

# characters of numa_maps read at most. A worker with the default vm.max_map_count
# (65530 mappings) prints about 8 MB; its owner, who may be any local user, could
# otherwise make root's daemon hold hundreds of MB (long file paths on every line)
NUMA_MAPS_LIMIT = 32 << 20

# comm is cut to 15 characters: "uvb_poll_window_thread" reads "uvb_poll_window"
UVB_COMM_PREFIX = "uvb_poll_window"


def _allowed_cpus(source: HostSource, key: str, status_cpus, warnings: list[str]):
    """(cpus, "cgroup"|"status", cpuset path): the cgroup cpuset when
    readable, else Cpus_allowed_list: never a mask ascendbind itself set."""
    cg_text = source.read(f"/proc/{key}/cgroup")
    where = cpuset_cgroup(parse_cgroup(cg_text, f"/proc/{key}/cgroup")) if cg_text is not None else None
    if where is not None:
        version, path = where
        rel = path.rstrip("/")
        if ".." not in rel.split("/"):
            file = (
                f"/sys/fs/cgroup/cpuset{rel}/cpuset.effective_cpus"
                if version == "v1"
                else f"/sys/fs/cgroup{rel}/cpuset.cpus.effective"
            )
            text = source.read(file)
            if text is not None:
                try:
                    cpus = parse_cpulist_file(text, file)
                except ParseError as exc:
                    warnings.append(f"{exc}; using Cpus_allowed_list")
                    cpus = frozenset()
                if cpus:
                    return cpus, "cgroup", path
    if status_cpus is None:
        raise ParseError(f"/proc/{key}/status", "no Cpus_allowed_list line")
    return status_cpus, "status", where[1] if where else None


def _warn_if_earlier_binding(source: HostSource, allowed: frozenset[int], warnings: list[str]) -> None:
    """Without a readable cpuset, Cpus_allowed_list may be a mask somebody (maybe
    ascendbind, maybe the worker itself) already set: say so, since planning from it
    would shrink the pool again."""
    text = source.read("/sys/devices/system/cpu/online")
    if text is None:
        return
    try:
        online = parse_cpulist_file(text, "/sys/devices/system/cpu/online")
    except ParseError:
        return
    if allowed < online:
        warnings.append(
            f"cgroup cpuset unreadable: planning from Cpus_allowed_list {format_cpulist(allowed)}, "
            f"narrower than the online CPUs {format_cpulist(online)}; it may be an earlier binding "
            "(release it first, or make the cpuset readable)"
        )


def _uvb_tids(source: HostSource) -> tuple[int, ...]:
    text = source.run(["ps", "-Te"])
    if text is not None:
        return tuple(sorted(t.tid for t in parse_ps_te(text) if t.comm.startswith(UVB_COMM_PREFIX)))
    # no ps (minimal container image): the same facts from /proc/*/task/*/comm
    tids: list[int] = []
    for pid in source.listdir("/proc") or ():
        if not pid.isdigit():
            continue
        for tid in source.listdir(f"/proc/{pid}/task") or ():
            comm = source.read(f"/proc/{pid}/task/{tid}/comm") if tid.isdigit() else None
            if comm is not None and comm.startswith(UVB_COMM_PREFIX):
                tids.append(int(tid))
    return tuple(sorted(set(tids)))


def discover_worker(
    source: HostSource, pid: int | None, config: Config, *, want_uvb: bool = False,
    identity: ProcessIdentity | None = None,
) -> WorkerFacts:
    """Per-request facts of one worker: allowed CPUs (cgroup cpuset when readable,
    else Cpus_allowed_list), Mems_allowed, start time, environ, threads (tid, comm),
    and with ``want_uvb`` the host's uvb_poll_window threads.

    ``pid`` None means ``/proc/self`` (the snapshot's proc/self/status).
    Raises ProcessGone when /proc/<pid>/status is absent. With ``identity`` (the
    process as read when the request was authorized), ProcessGone ``pid_recycled``
    when the facts were read from another process than that one.
    """
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0):
        raise UsageError(f"pid must be a positive integer, got {pid!r}")
    key = "self" if pid is None else str(pid)
    status_path = f"/proc/{key}/status"
    status_text = source.read(status_path)
    if status_text is None:
        raise ProcessGone(f"no process {key}: {status_path} is absent")
    status = parse_status(status_text, status_path)
    real_pid = pid if pid is not None else status.tgid
    if real_pid is None:
        raise ParseError(status_path, "no Tgid line")
    warnings: list[str] = []

    allowed, allowed_source, cpuset_path = _allowed_cpus(source, key, status.cpus_allowed, warnings)
    if allowed_source == "status":
        _warn_if_earlier_binding(source, allowed, warnings)

    env_text = source.read(f"/proc/{key}/environ")
    if env_text is not None:
        env = parse_environ(env_text)
    else:
        env = dict(getattr(source, "meta", {}).get("env") or {})

    threads: list[ThreadInfo] = []
    for tid in source.listdir(f"/proc/{key}/task") or ():
        if not tid.isdigit():
            continue
        comm = source.read(f"/proc/{key}/task/{tid}/comm")
        if comm is None:
            continue  # the thread exited while we listed
        threads.append(ThreadInfo(int(tid), comm.rstrip("\n")))
    threads.sort(key=lambda t: t.tid)

    # read last: a start time equal to the identity's proves every file above came
    # from that same process (a pid number never comes back with an old start time)
    stat_text = source.read(f"/proc/{key}/stat")
    start = parse_stat_start_time(stat_text, f"/proc/{key}/stat") if stat_text is not None else None
    if identity is not None and start is None:
        raise ProcessGone(f"process {real_pid} exited while it was being read", code="pid_gone")
    if identity is not None and (identity.pid != real_pid or start != identity.start_time):
        raise ProcessGone(
            f"pid {real_pid} was recycled while it was being read: started at tick {start}, "
            f"not {identity.start_time}",
            code="pid_recycled",
        )

    return WorkerFacts(
        pid=real_pid,
        start_time=start,
        allowed_cpus=allowed,
        allowed_source=allowed_source,
        mems_allowed=status.mems_allowed if status.mems_allowed is not None else frozenset(),
        env=frozen_map(env),
        threads=tuple(threads),
        cpuset_path=cpuset_path,
        uvb_tids=_uvb_tids(source) if want_uvb else (),
        warnings=tuple(warnings),
    )


def read_numa_residency(source: HostSource, pid: int, *, start_time: int | None = None,
                        limit: int = NUMA_MAPS_LIMIT) -> NumaResidency:
    """Resident memory of ``pid`` per NUMA node, from ``/proc/<pid>/numa_maps``.

    DiscoveryError when the file cannot be read (the process is gone, or reading
    another user's numa_maps needs CAP_SYS_PTRACE) or is longer than ``limit``
    (code ``too_large``), ParseError when it is malformed. With ``start_time``, ProcessGone ``pid_recycled`` when the pid
    names another process once the file is read: the counts would be a stranger's.
    """
    path = f"/proc/{int(pid)}/numa_maps"
    text = source.read(path, limit=limit)
    if text is None:
        raise DiscoveryError(f"cannot read {path}: the process is gone, or its memory map is not readable")
    if len(text) > limit:
        raise DiscoveryError(f"{path} is longer than {limit} characters; not read further", code="too_large")
    residency = parse_numa_maps(text, path)
    if start_time is not None:
        stat_text = source.read(f"/proc/{int(pid)}/stat")
        start = parse_stat_start_time(stat_text, f"/proc/{int(pid)}/stat") if stat_text is not None else None
        if start != start_time:
            raise ProcessGone(f"pid {pid} exited or was recycled while its numa_maps was read", code="pid_recycled")
    return residency
