"""Planner: (host facts, worker facts, target NPUs, config) -> Plan. Pure: no I/O, by location.

plan.py puts the rules together; codes.py is the fixed set of issue codes they
report; explain.py (``plan --explain``) and lint.py (config tensions) read a
plan and a config. The rules live in rooms, one subject each:

* pools/    each NPU's CPU pool and its roles: one file per rule family
            (``global_slice.py``, ``topo_affinity.py``, ``cluster950.py``),
            ``roles.py`` (the role split), ``cpuset_pool.py`` (the worker's own
            cpuset as its pool, and when), ``layout.py`` (the host's CPU/NUMA
            lookups, built once per plan);
* align/    NUMA alignment: ``providers.py`` (device/cpu/memory hints),
            ``hints.py`` (the kubelet merge), ``policy.py`` (the topology and
            cpu-bind policies as objects), ``alignment.py`` (the decision,
            precedence, failure reasons);
* npus/     the worker's NPUs: ``targets.py`` (which NPUs it drives: the
            evidence weighed by one rule) on ``ascend_env.py`` (the
            ``ASCEND_*`` variables), ``irqs.py`` (where each NPU's interrupts go);
* isolate/  the rest of the host: ``isolation.py`` (the housekeeping CPUs and
            what each isolation level does), ``driverwork.py`` (the NPU
            driver's per-device work by name).

tests/test_structure.py holds every module under this folder, and everything
it imports, to touching nothing on the host, and each room to the import rule
its ``__init__`` states.

Public API:
    make_plan(host, worker, targets, config, *, request_policy=None) -> Plan
    resolve_targets(host, worker, request) -> TargetDecision   (the worker's NPUs, from evidence)
    resolve_policy(request_policy, config) -> str      (Conflict "policy_mismatch")
    explain_plan(host, worker, plan, config) -> str
    lint_config(config, host) -> list[str]
    ALIGNMENT_FAILURE_REASONS                          (metrics label set)

Issue codes (``plan.errors`` / ``plan.warnings``), a fixed set (codes.py):

errors (the NPU is not planned; exit status 3)
    unknown_npu              the id is not a logical NPU of this host
    npu_out_of_range         global_slice: id >= the number of logical NPUs
    slice_too_small          global_slice: base = cpus // npus is below the role
                             minimum ("need 80 CPUs for 16 NPUs, cpuset has 64")
    pool_too_small           the final pool cannot hold the role split
    no_affinity              topo/950 mode, but npu-smi reports no affinity for the NPU
    affinity_outside_cpuset  the NPU's affinity does not meet the allowed CPUs
    spans_numa_nodes         950: affinity ∩ allowed lies on more than one node
    bad_threads_per_core     950: Thread(s) per core is not 1 or 2
    too_few_clusters         950: the node has fewer full clusters than NPUs before this one
    topology_rejected        the topology policy refused the NPU's alignment
    too_many_numa_nodes      the host has more NUMA nodes than max_numa_nodes allows

warnings (the NPU is planned)
    pools_overlap            topo_affinity: two NPUs' pools overlap because their
                             extended pools intersect without being identical
    extension_fallback       numa_extension = closest without node distances used next

Every reason is a sentence with the numbers an operator needs.
"""

from .align.alignment import ALIGNMENT_FAILURE_REASONS, resolve_policy
from .codes import ERROR_CODES, WARNING_CODES
from .explain import explain_plan
from .lint import lint_config
from .npus.targets import resolve_targets
from .plan import make_plan

__all__ = ["make_plan", "resolve_targets", "resolve_policy", "explain_plan", "lint_config",
           "ALIGNMENT_FAILURE_REASONS", "ERROR_CODES", "WARNING_CODES"]
