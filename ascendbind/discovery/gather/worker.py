"""Per-request facts of one worker process, through a HostSource.

``worker_facts`` builds them from one observation of the process
(discovery/gather/process.py's ``ProcessView``) and reads nothing; ``discover_worker``
observes and builds, for callers that have no view yet. The observation is
cheap by design (a daemon makes one per bind): a few small /proc files, one
``comm`` per thread, the cgroup cpuset file; ``ps -Te`` only with ``want_uvb``
(Ascend 950).

``read_numa_residency`` is not: the kernel walks every page table of the
process to print ``numa_maps`` (about a second for a 100 GiB heap of 4 KiB
pages), so it never runs on the bind path, only in the daemon's rate-limited
locality check and in ``status --memory``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ...values.config import Config
from ...values.cpulist import format_cpulist
from ...errors import DiscoveryError, ParseError, ProcessGone
from ...values.frozen import frozen_map
from ...values.model import PoolEvidence, ProcessIdentity, WorkerFacts
from ...values.targeting import NpuEvidence
from .deviceset import read_npu_evidence
from ..parse.kubelet import CHECKPOINT_LIMIT, CHECKPOINT_PATH, judge_own_cpus, parse_cpu_manager_state, kubelet_place
from ..parse.numa_maps import NumaResidency, parse_numa_maps
from .process import ProcessView, check_same_process, observe_process
from ..parse.procfs import parse_ps_te, parse_stat_start_time, parse_status
from ..read.sources import HostSource
from ..parse.sysfs import parse_cpulist_file

__all__ = ["discover_worker", "worker_facts", "without_process_table", "read_numa_residency", "read_memory_file",
           "check_start_time", "read_pool_evidence", "UVB_COMM_PREFIX", "NUMA_MAPS_LIMIT"]

# characters of numa_maps read at most. A worker with the default vm.max_map_count
# (65530 mappings) prints about 8 MB; its owner, who may be any local user, could
# otherwise make root's daemon hold hundreds of MB (long file paths on every line)
NUMA_MAPS_LIMIT = 32 << 20

# comm is cut to 15 characters: "uvb_poll_window_thread" reads "uvb_poll_window"
UVB_COMM_PREFIX = "uvb_poll_window"


def _allowed_cpus(view: ProcessView, warnings: list[str], thread_cpus: Mapping[int, frozenset[int]]):
    """(cpus, "cgroup"|"status", cpuset path): the cgroup cpuset when readable, else the
    union of the threads' Cpus_allowed_list: never a mask ascendbind set, and never one a
    thread set on itself (OpenMP's OMP_PROC_BIND pins the calling thread, often the main
    thread, before any binding)."""
    cs = view.cpuset
    if cs is not None and cs.file is not None and cs.text is not None:
        try:
            cpus = parse_cpulist_file(cs.text, cs.file)
        except ParseError as exc:
            warnings.append(f"{exc}; using Cpus_allowed_list")
            cpus = frozenset()
        if cpus:
            return cpus, "cgroup", cs.path
    main = view.status.cpus_allowed
    if main is None:
        raise ParseError(f"/proc/{view.key}/status", "no Cpus_allowed_list line")
    union = main.union(*thread_cpus.values())
    if union != main:
        warnings.append(f"the main thread's Cpus_allowed_list {format_cpulist(main)} is narrower than its threads' "
                        f"{format_cpulist(union)} (a thread pinned itself); planning from {format_cpulist(union)}")
    return union, "status", cs.path if cs else None


def _thread_cpus(source: HostSource, view: ProcessView) -> dict[int, frozenset[int]]:
    """Each thread's Cpus_allowed_list (read only when the cpuset cannot be)."""
    out = {}
    for t in view.tasks:
        path = f"/proc/{view.key}/task/{t.tid}/status"
        text = source.read(path)
        if text is None:
            continue
        try:
            cpus = parse_status(text, path).cpus_allowed
        except ParseError:
            continue
        if cpus:
            out[t.tid] = cpus
    return out


def _online(source: HostSource) -> frozenset[int] | None:
    text = source.read("/sys/devices/system/cpu/online")
    if text is None:
        return None
    try:
        return parse_cpulist_file(text, "/sys/devices/system/cpu/online")
    except ParseError:
        return None


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


def worker_facts(view: ProcessView, *, env_fallback: Mapping[str, str] | None = None,
                 online: frozenset[int] | None = None, uvb_tids: tuple[int, ...] = (),
                 thread_cpus: Mapping[int, frozenset[int]] | None = None,
                 npu_evidence: NpuEvidence | None = None) -> WorkerFacts:
    """The worker's facts from one observation of it (pure): allowed CPUs (cgroup cpuset
    when readable, else the union of its threads' Cpus_allowed_list), Mems_allowed, start
    time, environ, threads, and the NPU evidence read beside it.

    ``env_fallback``: the environment to use when the view has none (a snapshot
    records only a few variables, in meta.json). ``online``: the online CPUs, to warn
    when Cpus_allowed_list is narrower (it may be an earlier binding). ``thread_cpus``:
    tid -> Cpus_allowed_list of the threads, for a worker whose cpuset is unreadable.
    """
    warnings: list[str] = list(view.warnings)
    allowed, allowed_source, cpuset_path = _allowed_cpus(view, warnings, thread_cpus or {})
    if allowed_source == "status" and online is not None and allowed < online:
        warnings.append(
            f"cgroup cpuset unreadable: planning from Cpus_allowed_list {format_cpulist(allowed)}, "
            f"narrower than the online CPUs {format_cpulist(online)}; it may be an earlier binding "
            "(release it first, or make the cpuset readable)"
        )
    env = view.environ if view.environ is not None else frozen_map(env_fallback or {})
    mems = view.status.mems_allowed
    return WorkerFacts(
        pid=view.pid,
        start_time=view.start_time,
        allowed_cpus=allowed,
        allowed_source=allowed_source,
        mems_allowed=mems if mems is not None else frozenset(),
        env=env,
        threads=view.threads,
        cpuset_path=cpuset_path,
        uvb_tids=uvb_tids,
        warnings=tuple(warnings),
        npu_evidence=npu_evidence,
    )


def discover_worker(
    source: HostSource, pid: int | None, config: Config, *, want_uvb: bool = False,
    identity: ProcessIdentity | None = None, view: ProcessView | None = None, want_devices: bool = True,
) -> WorkerFacts:
    """Per-request facts of one worker (``worker_facts`` of one observation of it),
    with ``want_uvb`` the host's uvb_poll_window threads, and with ``want_devices`` the
    evidence of which NPUs it reaches and drives (deviceset.py).

    ``pid`` None means ``/proc/self`` (the snapshot's proc/self/status).
    Raises ProcessGone when /proc/<pid>/status is absent. With ``identity`` (the
    process as read when the request was authorized), ProcessGone ``pid_recycled``
    when the facts were read from another process than that one. ``view``: an
    observation this request already made (nothing of the process is read again).
    """
    if view is None:
        view = observe_process(source, pid)
    if identity is not None:
        check_same_process(view, identity)
    online, thread_cpus = None, None
    if view.status.cpus_allowed is not None and (view.cpuset is None or view.cpuset.text is None):
        online = _online(source)
        thread_cpus = _thread_cpus(source, view)
    evidence = read_npu_evidence(source, view) if want_devices else None
    facts = worker_facts(view, env_fallback=getattr(source, "meta", {}).get("env"), online=online,
                         uvb_tids=_uvb_tids(source) if want_uvb else (), thread_cpus=thread_cpus,
                         npu_evidence=evidence)
    if config.pool_source == "slice":
        return facts
    return dataclasses.replace(facts, pool_evidence=read_pool_evidence(source, facts))


def read_pool_evidence(source: HostSource, worker: WorkerFacts) -> PoolEvidence:
    """Whether the worker's cpuset is its own (discovery/parse/kubelet.py), reading kubelet's
    CPU manager checkpoint only for a worker in a pod's cgroup."""
    path, cpus = worker.cpuset_path, worker.allowed_cpus
    from_cgroup = worker.allowed_source == "cgroup"
    if not from_cgroup or kubelet_place(path).pod_uid is None:
        return judge_own_cpus(None, None, path, cpus, from_cgroup)
    text = source.read(CHECKPOINT_PATH, limit=CHECKPOINT_LIMIT)
    state, why = None, None
    if text is None:
        why = (f"{CHECKPOINT_PATH} is absent or unreadable (kubelet's CPU manager is not static there, or the "
               "file is not mounted into the daemon)")
    else:
        try:
            state = parse_cpu_manager_state(text, CHECKPOINT_PATH)
        except ParseError as exc:
            why = str(exc)
    return judge_own_cpus(state, why, path, cpus, from_cgroup)


def without_process_table(worker: WorkerFacts, why: str) -> WorkerFacts:
    """``worker`` with its evidence saying the process table was not consulted, and why."""
    ev = worker.npu_evidence or NpuEvidence()
    unavailable = frozen_map({**ev.unavailable, "process_table": why})
    return dataclasses.replace(worker, npu_evidence=dataclasses.replace(ev, unavailable=unavailable))


def read_numa_residency(source: HostSource, pid: int, *, start_time: int | None = None,
                        limit: int = NUMA_MAPS_LIMIT) -> NumaResidency:
    """Resident memory of ``pid`` per NUMA node, from ``/proc/<pid>/numa_maps``.

    DiscoveryError when the file cannot be read (the process is gone, or reading
    another user's numa_maps needs CAP_SYS_PTRACE) or is longer than ``limit``
    (code ``too_large``), ParseError when it is malformed. With ``start_time``, ProcessGone ``pid_recycled`` when the pid
    names another process once the file is read: the counts would be a stranger's.
    """
    text, path = read_memory_file(source, pid, "numa_maps", limit)
    residency = parse_numa_maps(text, path)
    if start_time is not None:
        check_start_time(source, pid, start_time, "its numa_maps")
    return residency


def read_memory_file(source: HostSource, pid: int, name: str, limit: int) -> tuple[str, str]:
    """(text, path) of ``/proc/<pid>/<name>`` (``maps``, ``numa_maps``): DiscoveryError when
    it cannot be read (the process is gone, or another user's needs CAP_SYS_PTRACE) or is
    longer than ``limit`` characters (code ``too_large``): a worker's owner may be any
    local user, and must not make root's daemon hold hundreds of MB."""
    path = f"/proc/{int(pid)}/{name}"
    text = source.read(path, limit=limit)
    if text is None:
        raise DiscoveryError(f"cannot read {path}: the process is gone, or its memory map is not readable")
    if len(text) > limit:
        raise DiscoveryError(f"{path} is longer than {limit} characters; not read further", code="too_large")
    return text, path


def check_start_time(source: HostSource, pid: int, start_time: int, what: str) -> None:
    """ProcessGone ``pid_recycled`` when ``pid`` no longer names the process started at
    ``start_time``: what was just read of it (``what``) would be a stranger's."""
    stat_text = source.read(f"/proc/{int(pid)}/stat")
    start = parse_stat_start_time(stat_text, f"/proc/{int(pid)}/stat") if stat_text is not None else None
    if start != start_time:
        raise ProcessGone(f"pid {pid} exited or was recycled while {what} was read", code="pid_recycled")
