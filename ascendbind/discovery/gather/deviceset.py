"""Read what says which NPUs a worker can reach and drives: ``NpuEvidence``, through a HostSource.

The reads (all small, all through ``source``, so a snapshot records and replays them):

* ``/proc/devices``: the driver's ``devdrv-cdev`` major. A host without it (no
  driver loaded, or CI) has no device set to read, and says so.
* ``/proc/<pid>/ns/mnt`` against ``/proc/1/ns/mnt``: the driver treats a process in
  the host's mount namespace as the host (every NPU); only a container's ``/dev``
  is a device set.
  Where pid 1's link is unreadable (a hardened host, some sandboxes), a worker whose
  ``NSpid`` (``/proc/<pid>/status``) shows a pid namespace below the reader's is taken
  as a container's: container runtimes give a container both namespaces, and taking
  it for the host would let a position among "its devices" name a host NPU.
* ``/proc/<pid>/ns/user`` against ``/proc/1/ns/user``: a mount namespace in the host's
  user namespace was made by a privileged process (a container runtime); one inside a
  user namespace of its own may be any user's, with any device nodes it could reach
  mounted in its ``/dev`` (daemon/watch/proof.py weighs it).
* ``/proc/<pid>/root/dev``: the worker's own ``/dev``, through its root, for nodes
  of that major (``char_devices``: no link followed, bounded).
* the worker's v1 devices cgroup, ``devices.list``: what the runtime lets it open.
* ``/proc/trs_core/proc``: the driver's process map, on drivers that have one.

A read that fails is recorded in ``unavailable`` with the reason; nothing here raises
for a missing or malformed file. The worker's ``/dev`` is whatever its mount namespace
mounted there, possibly a filesystem nobody serves: a live source lists it on
deadline.py's readers, and a listing that does not answer in time fails the request
(DiscoveryError ``read_timeout``, naming the directory) rather than weigh less evidence. After reading, the worker's start time is read again:
a pid recycled meanwhile would have lent its device set to the newcomer.
"""

from __future__ import annotations

from ...errors import ParseError, ProcessGone
from ...values.frozen import frozen_map
from ...values.targeting import CgroupDevices, NpuEvidence
from ..parse.devices import DEVDRV_CDEV, allowed_minors, devdrv_major, nested_pid_namespace, trs_core_udevids
from ..parse.procfs import parse_stat_start_time
from ..read.sources import HostSource, read_parsed

__all__ = ["read_npu_evidence", "TRS_CORE_PROC", "PROC_DEVICES"]

TRS_CORE_PROC = "/proc/trs_core/proc"
PROC_DEVICES = "/proc/devices"


def _major(source: HostSource, unavailable: dict[str, str]) -> int | None:
    major, why = read_parsed(source, PROC_DEVICES, devdrv_major)
    if major is not None:
        return major
    unavailable["device_nodes"] = unavailable["devices_cgroup"] = \
        why or f"{PROC_DEVICES} lists no {DEVDRV_CDEV} major: the NPU driver is not loaded here"
    return None


def _host_namespace(source: HostSource, key: str, kind: str = "mnt") -> bool | None:
    readlink = getattr(source, "readlink", None)
    if readlink is None:
        return None
    mine, init = readlink(f"/proc/{key}/ns/{kind}"), readlink(f"/proc/1/ns/{kind}")
    return None if mine is None or init is None else mine == init


def _container_by_pid_namespace(source: HostSource, key: str) -> bool:
    """Whether the worker lives in a pid namespace below the reader's (its status's NSpid)."""
    text = source.read(f"/proc/{key}/status")
    return text is not None and nested_pid_namespace(text) is True


def _cgroup_devices(source: HostSource, view, major: int, unavailable: dict[str, str]) -> CgroupDevices | None:
    entry = next((e for e in view.cgroup or () if "devices" in e.controllers), None)
    if entry is None:
        unavailable["devices_cgroup"] = ("no devices controller in /proc/<pid>/cgroup (cgroup v2 keeps the device "
                                         "rules in a BPF program, which is not readable)")
        return None
    rel = entry.path.rstrip("/")
    if ".." in rel.split("/"):
        unavailable["devices_cgroup"] = f"its devices cgroup {entry.path} lies outside this cgroup namespace"
        return None
    path = f"/sys/fs/cgroup/devices{rel}/devices.list"
    found, why = read_parsed(source, path, lambda text: CgroupDevices(allowed_minors(text, major, path), path))
    if why is not None:
        unavailable["devices_cgroup"] = why
    return found


def read_npu_evidence(source: HostSource, view) -> NpuEvidence:
    """The evidence about the process ``view`` observed (discovery's ``ProcessView``).
    ProcessGone ``pid_recycled`` when its pid names another process once read."""
    key, pid = view.key, view.pid
    unavailable: dict[str, str] = {}
    major = _major(source, unavailable)
    host_ns = _host_namespace(source, key)
    if host_ns is None and _container_by_pid_namespace(source, key):
        host_ns = False
    host_userns = _host_namespace(source, key, "user")
    nodes = None
    cgroup = None
    if major is not None:
        if host_ns:
            unavailable["device_nodes"] = "the worker is in the host's mount namespace"
        else:
            lister = getattr(source, "char_devices", None)
            try:
                found = lister(f"/proc/{key}/root/dev", major) if lister is not None else None
            except ParseError as exc:
                found, unavailable["device_nodes"] = None, str(exc)
            if found is not None:
                nodes = tuple(found)
            else:
                unavailable.setdefault("device_nodes", f"/proc/{pid}/root/dev is unreadable, a link, or too large "
                                                       "to list")
        cgroup = _cgroup_devices(source, view, major, unavailable)
    names = source.listdir(TRS_CORE_PROC)
    if names is None:
        unavailable["driver"] = f"{TRS_CORE_PROC} is absent (a driver without the process map)"
    if view.start_time is not None:
        text = source.read(f"/proc/{key}/stat")
        if text is None:
            raise ProcessGone(f"process {pid} exited while its devices were read", code="pid_gone")
        try:
            again = parse_stat_start_time(text, f"/proc/{key}/stat")
        except ParseError:
            again = None
        if again != view.start_time:
            raise ProcessGone(f"pid {pid} exited or was recycled while its devices were read", code="pid_recycled")
    return NpuEvidence(major=major, host_namespace=host_ns, host_user_namespace=host_userns, device_nodes=nodes, cgroup_devices=cgroup,
                       driver_udevids=None if names is None else trs_core_udevids(names, pid),
                       unavailable=frozen_map(unavailable))
