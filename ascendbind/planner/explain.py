"""``ascendbind plan --explain``: the hints, the merge and the decision, as text.

Pure: it re-derives the alignment from the same facts (the plan JSON keeps
only masks and flags; the providers' notes live here) and renders it with the
config lint warnings.
"""

from __future__ import annotations

from ..values.config import Config
from ..values.model import HostFacts, Plan, PoolChoice, WorkerFacts
from .align.alignment import PROVIDERS, NpuAlignment
from .pools.cpuset_pool import choose_pool_source
from .align.hints import Hint, mask_text
from .pools.layout import cl, nodes_text
from .lint import lint_config
from .plan import plan_with_alignment
from .align.policy import TopologyPolicy, topology_policy

__all__ = ["explain_plan"]


def _hint_line(provider: str, hint: Hint) -> str:
    pref = "preferred" if hint.preferred else "not preferred"
    return f"    {provider:<7} {mask_text(hint.mask):<10} {pref:<13} score {hint.score:<3} {hint.note}".rstrip()


def _npu_block(a: NpuAlignment, policy: TopologyPolicy) -> list[str]:
    lines = [f"NPU {a.npu}", "  hints"]
    for p in PROVIDERS:
        for h in a.hints.get(p, ()):
            lines.append(_hint_line(p, h))
    if a.merged is None:
        lines.append("  merge    not evaluated")
    elif not a.viable:
        lines.append(f"  merge    no combination of one hint per provider shares a NUMA node"
                     f"{' (after keeping single-node preferred hints)' if policy.prefers_single_node else ''}")
    else:
        picked = " AND ".join(f"{p} {mask_text(h.mask)}" for p, h in zip(PROVIDERS, a.merged.permutation))
        pref = "preferred" if a.merged.preferred else "not preferred"
        lines.append(f"  merge    {mask_text(a.merged.mask)}, {pref}, score {a.merged.score}  ({picked})")
    if not a.admitted:
        verdict = f"rejected by {policy.name}"
    elif a.rebuilt:
        verdict = (f"admitted; pool built inside {mask_text(a.merged.mask)}: {cl(a.pool)} "
                   f"(seed pool {cl(a.seed_pool)})")
    else:
        verdict = f"admitted; seed pool {cl(a.pool)} on NUMA {nodes_text(a.pool_nodes)}"
    lines.append(f"  decision {verdict}; {'aligned' if a.aligned else 'not aligned'}")
    if a.reason:
        lines.append(f"  why      {a.reason}" + (f" [{a.failure}]" if a.failure else ""))
    return lines


def _source_line(plan: Plan, config: Config, worker: WorkerFacts) -> str:
    """Where the pools came from (``pool_source``) and the evidence for it."""
    choice = plan.pool_source or choose_pool_source(config, worker)
    if plan.pool_source is None and choice.source == "cpuset":
        choice = PoolChoice("slice", choice.requested, "the plan was made by the placement rules")
    where = "the worker's own cpuset" if choice.source == "cpuset" else "the placement rules"
    return f"pools: {where} (pool_source {choice.requested}): {choice.evidence}"


def explain_plan(host: HostFacts, worker: WorkerFacts, plan: Plan, config: Config) -> str:
    policy = plan.alignment.policy if plan.alignment is not None else config.topology_policy
    targets = sorted({p.npu for p in plan.npus} | {e.npu for e in plan.errors if e.npu is not None})
    # the plan's policy is already resolved (request or config): plan with it, no second precedence check
    cfg = config.replace(topology_policy=policy, explicit=config.explicit - {"topology_policy"})
    _, alignment = plan_with_alignment(host, worker, targets, cfg, policy)

    source = "request" if policy != config.topology_policy else \
        ("node config" if "topology_policy" in config.explicit else "default")
    out = plan.targets.lines() if plan.targets is not None else []
    out += [
        f"alignment: topology_policy {policy} (from {source}), prefer_closest_numa "
        f"{str(config.prefer_closest_numa).lower()}, max_numa_nodes {config.max_numa_nodes}, numa_extension "
        f"{config.numa_extension}, cpu_bind_policy {config.cpu_bind_policy}",
        f"mode {plan.mode.value}" + (f" (fallback: {plan.fallback})" if plan.fallback else ""),
        _source_line(plan, cfg, worker),
    ]
    if alignment.note:
        out.append(f"note: {alignment.note}")
    chosen = topology_policy(policy)
    for a in alignment.npus:
        out.extend(_npu_block(a, chosen))
    unplanned = [e for e in plan.errors if e.npu not in {a.npu for a in alignment.npus}]
    for e in unplanned:
        out.append(f"NPU {e.npu}: not planned before alignment [{e.code}] {e.reason}")
    lint = lint_config(cfg, host)
    out.append("config lint" + ("" if lint else ": nothing to report"))
    out.extend(f"  - {w}" for w in lint)
    return "\n".join(out)
