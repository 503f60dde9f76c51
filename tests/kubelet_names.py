"""The cgroup paths a kubelet and its container runtime give a pod's container, derived
from how current releases name them, so the rule that reads them back is checked against
every layout, not only the one this machine's real kubelet shows (cgroup v1, cgroupfs).

The kubelet (pkg/kubelet/cm, ``CgroupName``) names a pod's cgroup by a list of parts:
``["kubepods"]`` for a Guaranteed pod, ``["kubepods", "burstable" | "besteffort"]``
otherwise, then ``"pod" + UID``. The cgroupfs driver joins the parts with ``/``. The
systemd driver turns each part's ``-`` into ``_``, joins the parts with ``-`` into one
slice name, and expands it the way systemd does (every ``-`` starts a child slice whose
name repeats its parents'): ``kubepods.slice/kubepods-burstable.slice/
kubepods-burstable-pod<uid with _>.slice``. The container runtime adds the container's
cgroup below the pod's: with cgroupfs the bare 64-hex ID; with systemd a scope named
``<prefix>-<id>.scope`` where the prefix is the runtime's (containerd ``cri-containerd``,
CRI-O ``crio``, cri-dockerd ``docker``).

``/proc/<pid>/cgroup`` prints that path per hierarchy (cgroup v1: one line per
controller; v2: the ``0::`` line), relative to the reader's cgroup namespace root: a
reader in a namespace of its own (a container on cgroup v2) sees the path climb out of
its own cgroup first (``/../..``).
"""

from __future__ import annotations

__all__ = ["RUNTIME_PREFIX", "cgroup_parts", "cgroupfs_path", "systemd_path", "container_path", "as_seen_from"]

RUNTIME_PREFIX = {"containerd": "cri-containerd", "cri-o": "crio", "cri-dockerd": "docker"}


def cgroup_parts(qos: str, uid: str) -> list[str]:
    """The kubelet's parts of a pod's cgroup name (qos: guaranteed, burstable, besteffort)."""
    parts = ["kubepods"] if qos == "guaranteed" else ["kubepods", qos]
    return parts + ["pod" + uid]


def cgroupfs_path(parts: list[str]) -> str:
    return "/" + "/".join(parts)


def systemd_path(parts: list[str]) -> str:
    """One slice name from the escaped parts, expanded into its parent slices."""
    name = "-".join(p.replace("-", "_") for p in parts)
    pieces = name.split("-")
    return "".join("/" + "-".join(pieces[:i + 1]) + ".slice" for i in range(len(pieces)))


def container_path(driver: str, runtime: str, qos: str, uid: str, container_id: str) -> str:
    parts = cgroup_parts(qos, uid)
    if driver == "cgroupfs":
        return cgroupfs_path(parts) + "/" + container_id
    return systemd_path(parts) + f"/{RUNTIME_PREFIX[runtime]}-{container_id}.scope"


def as_seen_from(path: str, reader: str) -> str:
    """``path`` as ``/proc/<pid>/cgroup`` prints it for a reader whose cgroup namespace is
    rooted at cgroup ``reader``: relative to it, climbing with ``..`` where it must."""
    mine = [p for p in reader.split("/") if p]
    theirs = [p for p in path.split("/") if p]
    common = 0
    while common < min(len(mine), len(theirs)) and mine[common] == theirs[common]:
        common += 1
    return "/" + "/".join([".."] * (len(mine) - common) + theirs[common:])
