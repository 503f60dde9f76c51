"""Who may isolate: whether a binding is *proven* to drive its NPUs, and by what. No I/O.

Binding needs no proof: anyone may bind a process of their own, and its threads
get their plan's CPUs. But a binding also acts on others: at ``irqs`` and
``host`` the rest of the host (other users' tasks, every IRQ) is moved off its
CPUs, and it holds its NPUs against another worker. Those two powers belong
only to a binding the daemon has reason to believe, a *proven* one:

* ``root``: the request came from uid 0 (``SO_PEERCRED``); root may bind any
  process, so root's word is the operator's;
* ``driver``: the driver's process map (``/proc/trs_core/proc``) holds the worker
  on each NPU it is bound to;
* ``process_table``: npu-smi's process table lists the worker's host pid on each
  of them (read by the bind, by auto-bind, or by the check after the answer,
  ``npu_check``);
* ``container_devices``: the worker is in a container whose ``/dev`` holds the
  driver's device nodes of each NPU, and that container was made by a privileged
  runtime: its mount namespace is not the host's, its user namespace is. An
  unprivileged user can only make a mount namespace inside a user namespace of
  its own, so a device set it arranged itself never counts;
* ``kubelet_pod``: the worker lives in a pod's cgroup under kubelet's
  ``kubepods`` hierarchy, at its top (a delegated subtree that merely names a
  cgroup ``kubepods`` further down proves nothing).

Everything else is the worker's own claim: the NPU a request names, an
``ASCEND_VISIBLE_DEVICES`` or ``ASCEND_RT_VISIBLE_DEVICES`` it set itself.
Such a binding is *unproven*: bound, but it protects nothing (isolation leaves
every other task and IRQ where it is) and holds nothing (a proven worker on its
NPU takes the NPU over, and it is released). An unproven binding becomes proven
when npu-smi's process table later lists it there (``prove``); until then it
is checked again now and then (npucheck.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from ...discovery.parse.kubelet import kubelet_place
from ...values.model import WorkerFacts
from ...values.targeting import TargetDecision

__all__ = ["Proof", "PROVEN_BY", "UNPROVEN", "proof_of", "from_root", "prove", "kept_on_rebind", "pod_at_top"]

# what proves a binding, strongest first (Proof.by when proven)
PROVEN_BY = ("root", "driver", "process_table", "container_devices", "kubelet_pod", "npu_check")
UNPROVEN = "claim"  # Proof.by of an unproven binding: the worker's own word
_NOT_RECORDED = "not_recorded"  # a state file written before proofs existed


@dataclass(frozen=True)
class Proof:
    """Whether a binding is proven (``proven``), by what (``by``), and the sentence why."""

    proven: bool
    by: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"proven": self.proven, "by": self.by, "detail": self.detail}

    @classmethod
    def from_json(cls, raw: Any) -> Proof:
        """Inverse of ``to_json``; anything else (an older state file) is unproven: the
        daemon checks it again rather than trust a record it cannot read."""
        if isinstance(raw, dict) and isinstance(raw.get("by"), str) and isinstance(raw.get("detail"), str):
            proven = raw.get("proven") is True and raw["by"] in PROVEN_BY
            return cls(proven, raw["by"][:40] if proven else UNPROVEN, raw["detail"][:2000])
        return cls(False, _NOT_RECORDED, "the state file did not record what proved this binding; npu-smi's "
                                         "process table is asked again")


def from_root(uid: int) -> Proof:
    return Proof(True, "root", f"bound at the request of uid {uid} (root)")


def _ids(npus: Iterable[int]) -> str:
    return ",".join(map(str, sorted(npus))) or "none"


def pod_at_top(path: str | None) -> bool:
    """Whether cgroup ``path`` is a pod's in the tree the kubelet made (kubelet.kubelet_place:
    ``kubepods`` at the hierarchy's top, or climbed to from a cgroup namespace of the
    daemon's own), never one a delegated subtree names further down."""
    return kubelet_place(path).pod_uid is not None


def proof_of(worker: WorkerFacts, decision: TargetDecision, npus: Collection[int], *, root_uid: int | None = None,
             listed: Collection[tuple[int, int]] | None = None) -> Proof:
    """What proves that ``worker`` drives ``npus`` (the NPUs it is being bound to), given
    the target rule's ``decision`` (its evidence lines), whether the request came from
    root (``root_uid`` 0), and npu-smi's (npu, pid) pairs if this bind read them."""
    want = set(npus)
    if root_uid == 0:
        return from_root(0)
    lines = {e.source: e for e in decision.evidence}
    for source in ("driver", "process_table"):
        line = lines.get(source)
        if line is not None and line.npus and want <= set(line.npus):
            return Proof(True, source, line.detail)
    if listed is not None and want and all((n, worker.pid) in listed for n in want):
        return Proof(True, "process_table", f"npu-smi info lists pid {worker.pid} on NPU {_ids(want)}")
    ev = worker.npu_evidence
    nodes = lines.get("device_nodes")
    if ev is not None and nodes is not None and nodes.npus and want <= set(nodes.npus) and \
            ev.host_namespace is False and ev.host_user_namespace is True:
        return Proof(True, "container_devices", f"a container made by a privileged runtime holds the device nodes "
                                                f"of NPU {_ids(want)}: {nodes.detail}")
    if pod_at_top(worker.cpuset_path):
        return Proof(True, "kubelet_pod", f"the worker is in kubelet's pod cgroup {worker.cpuset_path[:200]}")
    picked = {"request": f"the request names NPU {_ids(want)}",
              "device_index": "the request names a device index"}.get(
        decision.rule, f"the {decision.rule.replace('_', ' ')} rule picked NPU {_ids(want)} from what the worker set "
                       "itself")
    return Proof(False, UNPROVEN, f"{picked}; neither the driver, npu-smi, a container's device set nor a kubelet "
                                  f"pod shows pid {worker.pid} on it, and the request was not root's: bound, but "
                                  "it isolates nothing and holds the NPU against nobody until npu-smi lists it")


def prove(proof: Proof, verdict: str, why: str) -> Proof:
    """``proof`` after npu-smi's check (npucheck.py) said ``verdict``: a confirmed
    unproven binding is proven from now on; nothing else changes a proof."""
    if proof.proven or verdict != "confirmed":
        return proof
    return Proof(True, "npu_check", why)


def kept_on_rebind(proof: Proof, before: Proof | None, npus_before: Collection[int], npus: Collection[int]) -> Proof:
    """The proof of a process bound again (``before``: its held binding's, of ``npus_before``):
    a proven binding stays proven when the same process is bound again to the same NPUs,
    whoever asks (root's ``ascendbind run`` and then the worker's own plugin bind the same
    process: the second request is the worker's, but nothing about the process changed).
    Other NPUs are a new claim, weighed afresh."""
    if proof.proven or before is None or not before.proven or set(npus_before) != set(npus):
        return proof
    return before
