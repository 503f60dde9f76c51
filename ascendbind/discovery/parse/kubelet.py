"""kubelet's CPU manager checkpoint and a worker's place in a pod. Pure: text in, values out.

With ``cpuManagerPolicy: static`` kubelet gives each container of a Guaranteed pod
that asks for whole CPUs a set of CPUs of its own, takes them out of the shared
pool, and writes both to ``/var/lib/kubelet/cpu_manager_state`` (root-owned JSON):

    {"policyName": "static", "defaultCpuSet": "0-1,40-639",
     "entries": {"<pod UID>": {"<container name>": "200-239"}}, "checksum": 1234}

Older kubelets (checkpoint v1) keyed ``entries`` by container ID instead:
``{"<container id>": "200-239"}``. Both are read.

The checkpoint names containers, the kernel names cgroups. A container's
cgroup path carries its pod's UID (cgroupfs ``/kubepods/pod<uid>/<id>`` or
``/kubepods/burstable/pod<uid>/<id>``; systemd
``/kubepods.slice/kubepods-pod<uid with _ for ->.slice/cri-containerd-<id>.scope``)
and its container ID (the last component, less the runtime's prefix and
``.scope``), never its name. So the match is: the pod's UID from the worker's
cgroup picks the checkpoint's pod; within it, the container whose CPUs are
*exactly* the worker's cpuset is the worker's container (exclusive sets of one
pod never overlap, so at most one can match). A v1 checkpoint matches the
container ID directly, and its CPUs must equal the cpuset too.

What is proof that the worker's CPUs are its own: a ``static`` checkpoint whose
entry for the worker's pod (or container) is exactly the worker's cpuset, and
none of whose CPUs are in the shared pool (``defaultCpuSet``). What is not: a
cpuset narrower than the host (any runtime's ``--cpuset-cpus`` does that, and
so does a shared pool kubelet shrank), a pod without entries (Burstable, or
fractional CPUs), an entry that differs from the cpuset (a stale checkpoint,
or a container kubelet has not updated yet), a checkpoint of policy ``none``.
The checksum is kubelet's own (a hash of its Go structure): it is not
recomputed here; a checkpoint kubelet would reject is one kubelet rewrites.

Which cgroup paths are the kubelet's (``kubelet_place``): only its tree at the
top of a hierarchy, since a user may make any tree below a cgroup delegated to
it, and set its cpuset to another pod's exclusive CPUs there (cgroup v2's
delegated cpuset controller): a pod-looking cgroup deeper proves nothing. The kubelet's log
directories name a pod UID's namespace and pod, and a container ID's container.

The file is root's, but it is parsed as hostile input anyway: bounded length,
nesting and entry counts, CPU lists parsed only for the worker's own pod.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ...values.cpulist import format_cpulist, parse_cpulist
from ...errors import ParseError
from ...values.frozen import frozen_map
from ...values.model import PoolEvidence

__all__ = ["CHECKPOINT_PATH", "CHECKPOINT_LIMIT", "CpuManagerState", "PodPlace", "parse_cpu_manager_state",
           "kubelet_place", "judge_own_cpus",
           "parse_container_log", "parse_pod_log_dir", "is_container_name", "link_is_pods"]

CHECKPOINT_PATH = "/var/lib/kubelet/cpu_manager_state"
# a node of 110 pods of a few containers each writes a few KiB; 1 MiB is far past any real one
CHECKPOINT_LIMIT = 1 << 20
_MAX_PODS = 4096
_MAX_CONTAINERS = 256
_MAX_TEXT = 4096  # characters of one name or CPU list

# A pod UID has one of two forms. The API server gives a pod a UUID (8-4-4-4-12 hex digits, the
# systemd driver writes its dashes as ``_`` since ``-`` spells a slice's parents); the kubelet
# gives a static pod without ``metadata.uid`` the MD5 of its manifest and source: 32 hex digits,
# no dashes. Every rule here (cgroups, checkpoint keys, log directories) takes both, kept as
# the kubelet wrote them except for the systemd driver's ``_``.
_UID = r"(?:[0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}|[0-9a-fA-F]{32})"
_LOG_UID = r"(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32})"
_CONTAINER = re.compile(r"^(?:cri-containerd-|docker-|crio-|cri-o-|containerd-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class CpuManagerState:
    """A checkpoint as read: CPU lists stay text until one is needed (``cpus_of``)."""

    policy: str
    default_cpus: frozenset[int]
    # v2: pod UID -> container name -> cpulist text; v1: container id -> {"": cpulist text}
    entries: Mapping[str, Mapping[str, str]]
    version: int  # 1 or 2
    where: str

    def cpus_of(self, text: str) -> frozenset[int]:
        try:
            return parse_cpulist(text)
        except ValueError as exc:
            raise ParseError(self.where, f"entry: {exc}") from None


@dataclass(frozen=True)
class PodPlace:
    """Where a cgroup path puts a process: its pod's UID (lower case, a UUID's separators as
    dashes, a static pod's 32 hex digits as they are) and its container's ID."""

    pod_uid: str | None
    container_id: str | None


def _text(value, what: str, where: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ParseError(where, f"{what} is not a string of at most {_MAX_TEXT} characters")
    return value


def parse_cpu_manager_state(text: str, where: str = CHECKPOINT_PATH) -> CpuManagerState:
    """The checkpoint, checked for shape; ParseError naming ``where`` otherwise."""
    if len(text) > CHECKPOINT_LIMIT:
        raise ParseError(where, f"longer than {CHECKPOINT_LIMIT} characters")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ParseError(where, f"not JSON: {str(exc)[:120]}") from None
    if not isinstance(raw, dict):
        raise ParseError(where, "not a JSON object")
    policy = _text(raw.get("policyName"), "policyName", where)
    try:
        default = parse_cpulist(_text(raw.get("defaultCpuSet", ""), "defaultCpuSet", where))
    except ValueError as exc:
        raise ParseError(where, f"defaultCpuSet: {exc}") from None
    entries = raw.get("entries")
    entries = {} if entries is None else entries  # kubelet omits an empty map
    if not isinstance(entries, dict) or len(entries) > _MAX_PODS:
        raise ParseError(where, f"entries is not an object of at most {_MAX_PODS} keys")
    out: dict[str, Mapping[str, str]] = {}
    versions = set()
    for key, value in entries.items():
        key = _text(key, "an entries key", where)
        if isinstance(value, str):
            versions.add(1)
            out[key.lower()] = {"": _text(value, "a CPU list", where)}
        elif isinstance(value, dict) and len(value) <= _MAX_CONTAINERS:
            versions.add(2)
            for k, v in value.items():
                _text(k, "a container name", where), _text(v, "a CPU list", where)
            out[key.lower()] = value  # read-only from here: only judge_own_cpus reads it
        else:
            raise ParseError(where, f"entry {key[:60]!r} is neither a CPU list nor an object of at most "
                                    f"{_MAX_CONTAINERS} containers")
    if len(versions) > 1:
        raise ParseError(where, "entries mix the v1 (container id) and v2 (pod UID) layouts")
    return CpuManagerState(policy=policy, default_cpus=default, entries=frozen_map(out),
                           version=versions.pop() if versions else 2, where=where)


# The kubelet's tree, level by level: 0 its root, 1 a QoS class, 2 a pod. cgroupfs driver:
# kubepods / burstable|besteffort / pod<uid>; systemd driver: kubepods.slice /
# kubepods-<qos>.slice / kubepods[-<qos>]-pod<uid with _>.slice (a slice's name spells its
# parents). A Guaranteed pod hangs from the root directly.
_QOS_SLICE = re.compile(r"^kubepods-(burstable|besteffort)\.slice$")
_POD_DIR = re.compile(rf"^pod({_UID})$")
_POD_SLICE = re.compile(rf"^kubepods-(?:(burstable|besteffort)-)?pod({_UID})\.slice$")


def _kubelet_level(part: str) -> tuple[int, str, str | None, str | None] | None:
    """(level, driver, QoS class, pod UID) of one path component of the kubelet's tree."""
    if part in ("kubepods", "kubepods.slice"):
        return 0, "systemd" if part.endswith(".slice") else "cgroupfs", None, None
    if part in ("burstable", "besteffort"):
        return 1, "cgroupfs", part, None
    m = _QOS_SLICE.match(part)
    if m:
        return 1, "systemd", m.group(1), None
    m = _POD_DIR.match(part)
    if m:
        return 2, "cgroupfs", None, m.group(1)
    m = _POD_SLICE.match(part)
    if m:
        return 2, "systemd", m.group(1), m.group(2)
    return None


def kubelet_place(cgroup_path: str | None) -> PodPlace:
    """The pod UID and container ID of a cgroup the kubelet made, as ``/proc/<pid>/cgroup``
    prints it; PodPlace(None, None) for any other.

    Who can make which cgroup: the root of a hierarchy (v1: a controller's; v2: the
    unified one) and its children are root's; a delegated cgroup (systemd
    ``Delegate=yes``, a container's writable cgroupfs) is its user's, who can make any
    tree below it, ``kubepods/pod<uid>/<id>`` included. So the kubelet's tree is
    recognised only where nobody else can put it: ``kubepods`` at the top of the path,
    then at most a QoS class, then the pod, each in the kubelet's own order and one
    driver's names; the pod is the FIRST pod component and the container the component
    directly under it (what lies deeper, even pod-looking, is whatever the container
    made). A path that climbs (``/../..``, a v2 path printed for a reader in a cgroup
    namespace of its own, as a DaemonSet's container is) lands on an ancestor of the
    reader's own cgroup, made by root; it may start below the kubelet's root (at a QoS
    class or a pod) but must continue the same way."""
    if not cgroup_path or not cgroup_path.startswith("/"):
        return PodPlace(None, None)
    parts = [p for p in cgroup_path.split("/") if p]
    climbed = 0
    while climbed < len(parts) and parts[climbed] == "..":
        climbed += 1
    parts = parts[climbed:]
    if any(p in (".", "..") for p in parts):
        return PodPlace(None, None)
    last: tuple[int, str, str | None, str | None] | None = None
    for i, part in enumerate(parts):
        here = _kubelet_level(part)
        if here is None or (last is None and here[0] != 0 and not climbed):
            return PodPlace(None, None)
        if last is not None and not (here[0] > last[0] and here[1] == last[1]
                                     and (here[0] < 2 or here[2] == last[2] or here[1] == "cgroupfs")):
            return PodPlace(None, None)
        if here[0] == 2:
            c = _CONTAINER.match(parts[i + 1]) if i + 1 < len(parts) else None
            return PodPlace(here[3].replace("_", "-").lower(), c.group(1) if c else None)
        last = here
    return PodPlace(None, None)


def judge_own_cpus(state: CpuManagerState | None, why_none: str | None, cgroup_path: str | None,
                   cpus: frozenset[int], cpus_from_cgroup: bool) -> PoolEvidence:
    """Whether ``cpus`` (the worker's cpuset) are the worker's own, and the evidence either way.

    ``state`` is the checkpoint (None: ``why_none`` says why there is none to read)."""
    have = format_cpulist(cpus)
    if not cpus_from_cgroup:
        return PoolEvidence(False, "none", f"the worker's cgroup cpuset is unreadable, so its CPUs {have} "
                                           "cannot be matched to a CPU manager entry")
    place = kubelet_place(cgroup_path)  # a checkpoint entry is matched only to a pod that path proves
    if place.pod_uid is None:
        return PoolEvidence(False, "none", f"the worker's cgroup {(cgroup_path or '?')[:200]} is not a Kubernetes "
                                           f"pod's; a cpuset narrower than the host ({have}) is not proof by itself")
    if state is None:
        return PoolEvidence(False, "none", f"the worker is in pod {place.pod_uid}, but {why_none}")
    if state.policy != "static":
        return PoolEvidence(False, "none", f"{state.where} has policy {state.policy[:40]!r}, not static: kubelet "
                                           "gives no container CPUs of its own")
    if state.version == 1:
        key = place.container_id
        pod = {"container " + key[:12]: state.entries[key][""]} if key and key in state.entries else {}
    else:
        pod = dict(state.entries.get(place.pod_uid, {}))
    if not pod:
        return PoolEvidence(False, "none", f"{state.where} holds no exclusive CPUs for pod {place.pod_uid} "
                                           "(not Guaranteed with whole CPUs)")
    matches = []
    for name, text in sorted(pod.items()):
        if state.cpus_of(text) == cpus:
            matches.append(name)
    if len(matches) != 1:
        seen = "; ".join(f"{n or '?'}: {t[:60]}" for n, t in sorted(pod.items())[:4])
        return PoolEvidence(False, "none", f"no entry of pod {place.pod_uid} in {state.where} is exactly the "
                                           f"worker's cpuset {have} ({seen})")
    shared = cpus & state.default_cpus
    if shared:
        return PoolEvidence(False, "none", f"{state.where} gives container {matches[0]} CPUs {have}, but "
                                           f"{format_cpulist(shared)} are also in its shared pool: not exclusive")
    who = matches[0] if state.version == 1 else f"container {matches[0]!r} of pod {place.pod_uid}"
    return PoolEvidence(True, "kubelet_checkpoint", f"kubelet's static CPU manager gives {who} CPUs {have} "
                                                    f"({state.where})")


# The kubelet's log directories (root's, 0755), whose names are all that is read of them:
# /var/log/pods/<namespace>_<pod>_<pod uid>/<container>/<restarts>.log, and a link per
# container, /var/log/containers/<pod>_<namespace>_<container>-<container id>.log, to its
# current log in the first. Names follow Kubernetes' rules: a namespace and a container are
# DNS labels (63 characters), a pod a DNS subdomain (253).
_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
_SUBDOMAIN = r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?"
_LOG = re.compile(rf"^({_SUBDOMAIN})_({_LABEL})_({_LABEL})-([0-9a-f]{{64}})\.log$")
_POD_LOG_DIR = re.compile(rf"^({_LABEL})_({_SUBDOMAIN})_({_LOG_UID})$")
_CONTAINER_NAME = re.compile(rf"^{_LABEL}$")


def parse_container_log(name: str) -> tuple[str, str, str, str] | None:
    """(pod name, namespace, container name, container ID) from a container log link's name."""
    m = _LOG.match(name)
    return (m.group(1), m.group(2), m.group(3), m.group(4)) if m else None


def parse_pod_log_dir(name: str) -> tuple[str, str, str] | None:
    """(namespace, pod name, pod UID) from a pod's log directory name."""
    m = _POD_LOG_DIR.match(name)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def is_container_name(name: str) -> bool:
    return bool(_CONTAINER_NAME.match(name))


def link_is_pods(target: str, namespace: str, pod: str, pod_uid: str, container: str) -> bool:
    """Whether a container log link points where the kubelet puts that container's log:
    ``.../<namespace>_<pod>_<pod uid>/<container>/<n>.log``. The link's name carries the
    container ID, its target the pod UID: together they tie the names to the cgroup."""
    parts = target.split("/")
    return len(parts) >= 3 and parts[-3] == f"{namespace}_{pod}_{pod_uid}" and parts[-2] == container \
        and parts[-1].endswith(".log")
