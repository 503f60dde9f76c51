"""``pool_source``: the placement rules' pools, or the worker's own cpuset. Pure.

The placement rules assume every worker sees the same cpuset and cut it
between all the host's NPUs (``global_slice``) or share an affinity group with
the hidden NPUs of the group (``topo_affinity``). A worker whose CPUs are its
own — a Kubernetes Guaranteed pod under kubelet's static CPU manager, which the
Topology Manager aligned with the pod's NPU — would then get a slice of a
slice, or nothing (``slice_too_small``). With the cpuset as the source:

* the worker's cpuset is its NPU's pool: the role split (IRQ CPUs included)
  runs inside it and nothing outside it is used;
* a worker driving several NPUs has its cpuset split evenly between them in
  logical-id order (the last takes the remainder), in whole cores under
  ``cpu_bind_policy = full-pcpus``;
* alignment is judged as for any pool: against the NPU's affinity node(s),
  and a policy that aligns keeps only the part of the cpuset on the merged
  nodes — never CPUs outside it;
* on an Ascend 950 the host's UVB polling threads are not bound: they are the
  host's, and the worker's CPUs are not.

``slice`` is the placement rules exactly. ``cpuset`` always takes the cpuset.
``auto`` (the default) takes it only with proof that the CPUs are the worker's
own (discovery/parse/kubelet.py says what counts); otherwise the placement rules, and
the plan explanation says why.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...values.config import Config
from ...values.model import PoolChoice, WorkerFacts
from .layout import Layout

__all__ = ["choose_pool_source", "cpuset_pools"]


def choose_pool_source(config: Config, worker: WorkerFacts) -> PoolChoice:
    """Where this worker's pools come from under ``config.pool_source``, and the evidence."""
    wanted = config.pool_source
    ev = worker.pool_evidence
    if wanted == "slice":
        return PoolChoice("slice", wanted, "pool_source = slice: the placement rules cut the pools")
    if wanted == "cpuset":
        why = "pool_source = cpuset: the worker's cpuset is taken as its own"
        return PoolChoice("cpuset", wanted, why + (f" ({ev.detail})" if ev is not None else ""))
    if ev is not None and ev.own:
        return PoolChoice("cpuset", wanted, ev.detail)
    why = ev.detail if ev is not None else "the worker's CPUs were not looked at"
    return PoolChoice("slice", wanted, f"no proof the worker's CPUs are its own ({why}); the placement rules "
                                       "cut the pools")


def cpuset_pools(layout: Layout, targets: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """The worker's allowed CPUs as the pools of ``targets``: whole for one NPU, split evenly
    in logical-id order for several."""
    ordered = sorted(set(targets))
    if not ordered or not layout.allowed:
        return {}
    if len(ordered) == 1:
        return {ordered[0]: layout.allowed}
    return dict(zip(ordered, layout.split(list(layout.allowed), len(ordered))))
