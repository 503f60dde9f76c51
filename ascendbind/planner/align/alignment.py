"""NUMA alignment under ``topology_policy``, after the kubelet Topology Manager and Koordinator.

For every planned target NPU the device, cpu and memory providers offer hints
(providers.py), the hints are merged (hints.py), and the policy object
(policy.py: none, best-effort, restricted, single-numa-node) decides.

*Aligned* means the merged hint is preferred and the final pool lies on
exactly its nodes. A refused NPU becomes a ``topology_rejected`` plan error
whose sentence names the provider that could not agree and its masks — the
"why, not just no" kubelet cannot give. ``max_numa_nodes`` guards the
Cartesian product as kubelet does: above it, policies other than ``none``
refuse (``too_many_numa_nodes``) and ``none`` reports alignment as not
evaluated.

Precedence (Koordinator): request > node config > default; a request and a
node config that both name a policy and differ is a ``policy_mismatch``
Conflict, never silently merged (``resolve_policy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...values.config import CHOICES, Config
from ...errors import Conflict, UsageError
from ...values.model import PlanIssue
from ..codes import issue
from .hints import Hint, Merged, mask_of, mask_text, nodes_in
from ..pools.layout import cl, nodes_text
from .policy import TopologyPolicy
from .providers import (HintContext, build_in_mask, cpu_hints, cpu_shortfall, device_hints, memory_hints,
                        single_node_masks)

__all__ = ["POLICIES", "PROVIDERS", "ALIGNMENT_FAILURE_REASONS", "resolve_policy", "NpuAlignment",
           "Alignment", "align"]

POLICIES: tuple[str, ...] = CHOICES["topology_policy"]
PROVIDERS: tuple[str, ...] = ("device", "cpu", "memory")

# Why an NPU is not aligned: the label set of ascendbind_alignment_failures_total{reason}.
ALIGNMENT_FAILURE_REASONS: tuple[str, ...] = (
    "pool_off_mask",  # the hints agree, but the kept seed pool is on other nodes
    "cpu_no_fit",  # no single node can hold a pool meeting the role minimum for this NPU
    "device_cpu_mismatch",  # the device's node cannot hold the NPU's pool
    "memory_mismatch",  # Mems_allowed excludes the node device and cpu agree on
    "providers_disagree",  # no preferred merge for another combination of reasons
    "too_many_numa_nodes",  # more NUMA nodes than max_numa_nodes: not evaluated
    "no_numa_info",  # the host reports no NUMA nodes
)


def resolve_policy(request_policy: str | None, config: Config) -> str:
    """Koordinator precedence: request > node config > default.

    Raises UsageError for an unknown policy name and Conflict(code="policy_mismatch")
    when the request and an explicitly configured node policy differ.
    """
    if request_policy is None or request_policy == "":
        return config.topology_policy
    if request_policy not in POLICIES:
        raise UsageError(f"topology_policy must be one of {', '.join(POLICIES)}; got {request_policy!r}",
                         code="bad_policy")
    if "topology_policy" in config.explicit and request_policy != config.topology_policy:
        raise Conflict(
            f"the request asks for topology_policy {request_policy} but this node is configured with "
            f"{config.topology_policy}; a request may only repeat the node's policy (drop it from the request "
            f"or change the node config)", code="policy_mismatch")
    return request_policy


@dataclass
class NpuAlignment:
    npu: int
    hints: dict[str, list[Hint]]
    merged: Merged | None  # None when not evaluated
    viable: bool
    admitted: bool
    aligned: bool
    pool: tuple[int, ...]
    seed_pool: tuple[int, ...]
    rebuilt: bool
    failure: str | None
    reason: str | None
    pool_nodes: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        merged = self.merged if self.viable else None
        return {
            "aligned": self.aligned,
            "admitted": self.admitted,
            "numa_nodes": list(nodes_in(merged.mask)) if merged else [],
            "preferred": bool(merged and merged.preferred),
            "score": merged.score if merged else 0,
            "pool_numa_nodes": list(self.pool_nodes),
            "rebuilt": self.rebuilt,
            "failure": self.failure,
            "reason": self.reason,
        }


@dataclass
class Alignment:
    policy: str
    npus: list[NpuAlignment] = field(default_factory=list)
    errors: list[PlanIssue] = field(default_factory=list)
    note: str | None = None  # plan-wide reason (guard, no NUMA info)

    def to_json(self) -> dict[str, Any]:
        per = {str(a.npu): a.to_json() for a in self.npus}
        reasons = [(a.npu, a.reason) for a in self.npus if a.reason]
        if len(self.npus) == 1 and reasons:
            reason = reasons[0][1]
        else:
            reason = "; ".join(f"NPU {n}: {r}" for n, r in reasons) or None
        if reason is None and self.note:
            reason = self.note
        providers: dict[str, list] = {p: [] for p in PROVIDERS}
        for a in self.npus:
            for p in PROVIDERS:
                providers[p].extend(h.to_json(a.npu) for h in a.hints.get(p, ()))
        nodes = sorted({n for a in self.npus if a.viable and a.merged for n in nodes_in(a.merged.mask)})
        return {
            "policy": self.policy,
            "aligned": bool(self.npus) and all(a.aligned for a in self.npus),
            "numa_nodes": nodes,
            "providers": providers,
            "reason": reason,
            "failure": next((a.failure for a in self.npus if a.failure), None),
            "npus": per,
        }


def align(ctx: HintContext, targets: Sequence[int], policy: TopologyPolicy) -> Alignment:
    """Decide every planned target's pool under ``policy``; ``ctx.pools`` holds the seed pools."""
    out = Alignment(policy=policy.name)
    machine_nodes = sorted(set(ctx.host.numa_nodes) | set(ctx.layout.nodes))
    machine = mask_of(machine_nodes)
    config = ctx.config
    if not machine or len(machine_nodes) > config.max_numa_nodes:
        code = "no_numa_info" if not machine else "too_many_numa_nodes"
        out.note = ("the host reports no NUMA nodes" if not machine else
                    f"the host has {len(machine_nodes)} NUMA nodes, above max_numa_nodes = "
                    f"{config.max_numa_nodes}; raise max_numa_nodes to evaluate alignment")
        for npu in targets:
            seed = ctx.pools[npu]
            if policy.aligns:
                out.errors.append(issue(npu, "too_many_numa_nodes" if machine else "topology_rejected",
                                        f"topology_policy {policy.name} cannot align NPU {npu}: {out.note}"))
            out.npus.append(NpuAlignment(npu=npu, hints={}, merged=None, viable=False, admitted=not policy.aligns,
                                         aligned=False, pool=seed, seed_pool=seed, rebuilt=False, failure=code,
                                         reason=f"alignment not evaluated: {out.note}",
                                         pool_nodes=ctx.layout.nodes_of(seed)))
        return out

    for npu in targets:
        out.npus.append(_align_one(ctx, npu, policy, machine))
        a = out.npus[-1]
        if not a.admitted:
            out.errors.append(issue(npu, "topology_rejected",
                                    f"topology_policy {policy.name} rejects NPU {npu}: {a.reason}"))
    return out


def _align_one(ctx: HintContext, npu: int, policy: TopologyPolicy, machine: int) -> NpuAlignment:
    hints = {"device": device_hints(ctx, npu), "cpu": cpu_hints(ctx, npu), "memory": memory_hints(ctx, npu)}
    merged, viable = policy.merge([hints[p] for p in PROVIDERS], machine,
                                  prefer_closest=ctx.config.prefer_closest_numa, distances=ctx.layout.distances)
    ok = policy.fits(merged, viable)
    seed = ctx.pools[npu]
    pool, rebuilt = seed, False
    if ok and policy.aligns:
        built = build_in_mask(ctx, npu, merged.mask)
        if built and ctx.valid(built):
            pool, rebuilt = built, built != seed
        else:
            ok = False  # the cpu provider offered it, so this is a bug guard, not a policy outcome
    admitted = policy.admit(ok)
    pool_nodes = ctx.layout.nodes_of(pool)
    aligned = admitted and viable and merged.preferred and pool_nodes == nodes_in(merged.mask)
    failure = reason = None
    if not aligned:
        failure, reason = _diagnose(ctx, npu, hints, merged if viable else None, pool, policy)
    return NpuAlignment(npu=npu, hints=hints, merged=merged, viable=viable, admitted=admitted, aligned=aligned,
                        pool=pool if admitted else seed, seed_pool=seed, rebuilt=rebuilt and admitted,
                        failure=failure, reason=reason, pool_nodes=pool_nodes)


def _diagnose(ctx: HintContext, npu: int, hints: dict[str, list[Hint]], merged: Merged | None,
              pool: tuple[int, ...], policy: TopologyPolicy) -> tuple[str, str]:
    """The failure code and the sentence naming the providers that disagreed."""
    dev = single_node_masks(hints["device"])
    cpu = single_node_masks(hints["cpu"]) or set()
    mem = single_node_masks(hints["memory"])
    dev_text = "device has no NUMA preference" if dev is None else \
        f"device wants NUMA {nodes_text(sorted(n for m in dev for n in nodes_in(m)))}"
    kept = policy.kept_note

    if merged is not None and merged.preferred:
        lead = dev_text if dev is not None else f"the hints agree on {mask_text(merged.mask)}"
        why = f"{lead}; cpu pool {cl(pool)} is on NUMA {nodes_text(ctx.layout.nodes_of(pool))}"
        return "pool_off_mask", why + (f" ({kept})" if kept else "")

    if not cpu:
        failure, why = "cpu_no_fit", cpu_shortfall(ctx, npu)
    elif dev is not None and not (dev & cpu):
        wanted = sorted(n for m in dev for n in nodes_in(m))
        failure = "device_cpu_mismatch"
        why = f"{dev_text}; {cpu_shortfall(ctx, npu, wanted)}"
    else:
        common = cpu if dev is None else dev & cpu
        if mem is not None and not (common & mem):
            failure = "memory_mismatch"
            agree = "cpu offers" if dev is None else "device and cpu agree on"
            why = (f"memory: Mems_allowed is NUMA {nodes_text(ctx.worker.mems_allowed)}, but {agree} "
                   f"NUMA {nodes_text(sorted(n for m in common for n in nodes_in(m)))}")
        else:
            failure = "providers_disagree"
            why = "no single NUMA node satisfies the device, cpu and memory hints together"
    return failure, why + (f" ({kept})" if kept else "")
