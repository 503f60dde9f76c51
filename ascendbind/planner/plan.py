"""Entry point of the planner: facts + targets + config -> Plan. Pure.

Order of work, each step in its own module:

1. mode by device type (A3 -> global_slice, 950 -> ascend950_cluster, else
   topo_affinity, which falls back to global_slice when the host reports no
   CPU affinity at all);
2. the seed pools (global_slice.py, topo_affinity.py, cluster950.py), or the
   worker's own cpuset where ``pool_source`` says so (cpuset_pool.py);
3. NUMA alignment under ``topology_policy`` (alignment.py: hints from
   providers.py merged as in hints.py), which may rebuild a pool inside the
   merged NUMA mask or refuse the NPU; the decision lands in
   ``plan.alignment``;
4. the role split (roles.py), and the shares of main of the configured thread
   classes (none on Ascend 950, whose threads all take the whole cluster).

Per-NPU problems never raise: they become ``plan.errors`` and the NPU is left
out of ``plan.npus``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..values.config import Config
from ..values.decisions import PlanAlignment
from ..values.model import DeviceType, HostFacts, Mode, NpuPlan, Plan, PlanIssue, WorkerFacts
from .align.alignment import Alignment, align, resolve_policy
from .pools.cluster950 import cluster_pools
from .pools.cpuset_pool import choose_pool_source, cpuset_pools
from .codes import issue
from .pools.global_slice import slice_pools, total_npus
from .pools.layout import Layout, cl
from .align.policy import cpu_bind_policy, topology_policy
from .align.providers import HintContext
from .pools.roles import RoleSplitError, class_cpus, role_minimum, split_roles
from .pools.topo_affinity import affinity_pools

__all__ = ["make_plan", "plan_with_alignment", "choose_mode", "effective_device_type", "SeedPools", "seed_pools"]

FALLBACK_NO_AFFINITY = (
    "npu-smi info -t topo reports no CPU affinity on this host, so topo_affinity fell back to "
    "global_slice (pools cut from the cpuset by global logical NPU id)"
)


def effective_device_type(host: HostFacts, config: Config) -> DeviceType:
    if config.device_type and config.device_type != "auto":
        return DeviceType(config.device_type)
    return host.device_type


def choose_mode(device_type: DeviceType, host: HostFacts) -> tuple[Mode, str | None]:
    """The mode for a device type, and the fallback sentence when topo_affinity has no affinity."""
    if device_type is DeviceType.A3:
        return Mode.GLOBAL_SLICE, None
    if device_type is DeviceType.A950:
        return Mode.ASCEND950_CLUSTER, None
    if not host.topo_affinity:
        return Mode.GLOBAL_SLICE, FALLBACK_NO_AFFINITY
    return Mode.TOPO_AFFINITY, None


class SeedPools:
    """The placement rules' seed pools for one request, kept whole for the alignment step."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.pools: dict[int, tuple[int, ...]] = {}  # targets (and, in topo modes, hidden candidates)
        self.candidates: tuple[int, ...] = ()
        self.extended: dict[int, frozenset[int]] = {}
        self.errors: list[PlanIssue] = []
        self.warnings: list[PlanIssue] = []
        self.uvb_cpus: tuple[int, ...] = ()
        self.total: int = 0


def seed_pools(host: HostFacts, layout: Layout, mode: Mode, targets: Sequence[int], config: Config) -> SeedPools:
    seed = SeedPools(mode)
    if mode is Mode.GLOBAL_SLICE:
        total, source = total_npus(host, targets)
        seed.total = total
        pools, issues = slice_pools(layout, targets, total, role_minimum(config), source)
        seed.pools, seed.errors = pools, issues
        seed.candidates = tuple(sorted(pools))
    elif mode is Mode.TOPO_AFFINITY:
        res = affinity_pools(layout, host.topo_affinity, targets, config.numa_extension)
        seed.pools, seed.extended, seed.candidates = res.pools, res.extended, res.candidates
        seed.errors, seed.warnings = res.errors, res.warnings
        if config.numa_extension == "closest" and not layout.has_distances():
            seed.warnings.append(issue(None, "extension_fallback",
                                       "numa_extension = closest needs NUMA distances "
                                       "(/sys/devices/system/node/node*/distance), which this host does not "
                                       "report; pools were extended to the next node instead"))
    else:
        res = cluster_pools(layout, host.topo_affinity, targets, host.threads_per_core)
        seed.pools, seed.errors, seed.uvb_cpus = res.pools, res.errors, res.uvb_cpus
        seed.candidates = tuple(sorted(res.pools))
    return seed


def make_plan(host: HostFacts, worker: WorkerFacts, targets: Sequence[int], config: Config, *,
              request_policy: str | None = None) -> Plan:
    """The plan for ``targets``. Never raises for a per-NPU problem: it goes into ``plan.errors``
    (code + sentence with the numbers) and the NPU is absent from ``plan.npus``.
    Planning uses ``worker.allowed_cpus`` only (never a mask ascendbind set).

    ``request_policy`` is a per-request ``topology_policy`` (the API's bind
    field); it goes through ``resolve_policy`` and so may raise
    Conflict(code="policy_mismatch") or UsageError — request-level problems,
    not per-NPU ones.
    """
    return plan_with_alignment(host, worker, targets, config, resolve_policy(request_policy, config))[0]


def plan_with_alignment(host: HostFacts, worker: WorkerFacts, targets: Sequence[int], config: Config,
                        policy: str) -> tuple[Plan, Alignment]:
    """make_plan with an already resolved policy, also returning the alignment decisions
    (hints with their notes) that explain.py renders."""
    device_type = effective_device_type(host, config)
    layout = Layout.build(host, worker.allowed_cpus, full_pcpus=cpu_bind_policy(config.cpu_bind_policy).whole_cores)
    mode, fallback = choose_mode(device_type, host)
    source = choose_pool_source(config, worker)
    own = source.source == "cpuset"
    errors: list[PlanIssue] = []
    known = set(host.logic_ids)
    wanted: list[int] = []
    for npu in sorted(set(targets)):
        # global_slice reports ids past the end itself (npu_out_of_range)
        if npu < 0 or (known and npu not in known and (own or mode is not Mode.GLOBAL_SLICE)):
            errors.append(_unknown_npu(npu, known))
        else:
            wanted.append(npu)
    seed = _seed(host, layout, mode, wanted, config, own=own, errors=errors)
    failed = {e.npu for e in errors}

    planned = [npu for npu in wanted if npu not in failed and npu in seed.pools]
    ctx = HintContext(host=host, worker=worker, layout=layout, config=config, mode=mode, device_type=device_type,
                      pools=seed.pools, candidates=tuple(seed.extended), own_cpuset=own)
    alignment = align(ctx, planned, topology_policy(policy))
    rebuilt = set()
    for a in alignment.npus:
        if a.rebuilt:
            seed.pools[a.npu] = a.pool
            rebuilt.add(a.npu)
    errors.extend(alignment.errors)
    failed |= {e.npu for e in alignment.errors}
    # a pools_overlap warning about the seed pool no longer applies once the pool is rebuilt
    warnings = [w for w in seed.warnings if w.npu not in rebuilt]

    ascend950 = mode is Mode.ASCEND950_CLUSTER
    npus = _npu_plans([npu for npu in wanted if npu not in failed], seed.pools, config, layout,
                      ascend950=ascend950, errors=errors)
    return Plan(
        mode=mode,
        device_type=device_type,
        fallback=fallback,
        allowed_cpus=layout.allowed,
        npus=tuple(npus),
        uvb_cpus=seed.uvb_cpus if ascend950 else (),
        uvb_tids=tuple(worker.uvb_tids) if ascend950 else (),
        errors=tuple(sorted(errors, key=lambda e: (e.npu if e.npu is not None else -1, e.code))),
        warnings=tuple(warnings),
        alignment=PlanAlignment.from_json(alignment.to_json()),
        pool_source=source if own else None,
        thread_classes=config.thread_classes,
    ), alignment


def _unknown_npu(npu: int, known: set[int]) -> PlanIssue:
    return issue(npu, "unknown_npu", f"NPU {npu} is not a logical NPU of this host (npu-smi info -m lists {cl(known)})")


def _seed(host: HostFacts, layout: Layout, mode: Mode, wanted: list[int], config: Config, *, own: bool,
          errors: list[PlanIssue]) -> SeedPools:
    """The first pools of ``wanted``, before alignment (the cpuset's own when ``own``); the
    pool rules' errors about them, and global_slice's unknown ids inside its slice count,
    join ``errors``."""
    if own:
        seed = SeedPools(mode)
        seed.pools = cpuset_pools(layout, wanted)
        seed.candidates = tuple(sorted(seed.pools))
    else:
        seed = seed_pools(host, layout, mode, wanted, config)
    known = set(host.logic_ids)
    if mode is Mode.GLOBAL_SLICE and known and not own:
        for npu in wanted:
            if npu < seed.total and npu not in known:
                seed.pools.pop(npu, None)
                errors.append(_unknown_npu(npu, known))
    errors.extend(e for e in seed.errors if e.npu in wanted)
    return seed


def _npu_plans(npus: list[int], pools: Mapping[int, frozenset[int]], config: Config, layout: Layout, *,
               ascend950: bool, errors: list[PlanIssue]) -> list[NpuPlan]:
    """Each of ``npus`` with a pool, split into its roles; a pool too small joins ``errors``."""
    out: list[NpuPlan] = []
    for npu in npus:
        pool = pools.get(npu)
        if pool is None:
            continue
        try:
            roles = split_roles(pool, config, layout, ascend950=ascend950)
        except RoleSplitError as exc:
            errors.append(issue(npu, "pool_too_small", str(exc)))
            continue
        out.append(NpuPlan(npu=npu, pool=pool, irq=roles.irq, main=roles.main, acl=roles.acl,
                           release=roles.release, numa_nodes=layout.nodes_of(pool),
                           classes=() if ascend950 else class_cpus(roles.main, config.thread_classes)))
    return out
