"""Planner speed and memory on synthetic hosts.

    .venv/bin/python bench/plan.py [--repeat N] [--json PATH]

For hosts of 192 to 4096 CPUs and 8 to 128 NPUs, prints the median wall time
of ``make_plan`` (over N runs) and its peak traced memory, for one target NPU
and for every NPU at once, in each mode, with the default config (the placement
rules' pools plus the alignment report) and with ``topology_policy = single-numa-node``
(``max_numa_nodes`` raised to 64 so the 16- and 32-node hosts are evaluated).
Target: 4096 CPUs / 128 NPUs under 20 ms with the default config. The host
facts are built in memory, so this measures the planner only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ascendbind.values.config import Config  # noqa: E402
from ascendbind.values.frozen import frozen_map  # noqa: E402
from ascendbind.values.model import CpuInfo, DeviceType, HostFacts, WorkerFacts  # noqa: E402
from ascendbind.values.model import NpuChip  # noqa: E402
from ascendbind.planner import make_plan  # noqa: E402
from bench.common import write_json  # noqa: E402

TARGET_MS = 20.0

# (cpus, numa nodes, npus)
SHAPES = [(192, 8, 8), (640, 8, 16), (1024, 16, 32), (1024, 16, 64), (4096, 32, 64), (4096, 32, 128)]


def build_host(n_cpus: int, n_nodes: int, n_npus: int, device_type: DeviceType,
               every_node: bool = False) -> HostFacts:
    per = n_cpus // n_nodes
    nodes = {n: frozenset(range(n * per, (n + 1) * per)) for n in range(n_nodes)}
    cpus = tuple(CpuInfo(cpu=c, node=c // per, socket=c // (n_cpus // 2), core=c // 2, online=True)
                 for c in range(n_cpus))
    # NPUs grouped on every other node, like the 8x910B boards (pairs on nodes 0, 2, 4, 6)
    affinity = {}
    if device_type is not DeviceType.A3:
        # every_node: NPUs on every node, so each node's extension reaches its neighbour's NPUs
        # and pools overlap (the worst case for the pools_overlap check)
        step = 1 if every_node else 2
        per_node = -(-n_npus // max(1, n_nodes // step))
        for npu in range(n_npus):
            affinity[npu] = nodes[(step * (npu // per_node)) % n_nodes]
    dist = {a: tuple(10 if a == b else (20 if a // 4 == b // 4 else 30) for b in range(n_nodes))
            for a in range(n_nodes)}
    return HostFacts(
        cpus=cpus,
        threads_per_core=1,  # 8-CPU clusters on the 950 shapes
        numa_nodes=frozen_map(nodes),
        numa_distances=frozen_map(dist),
        chips=tuple(NpuChip(card=i, chip=0, logic_id=i, name="bench") for i in range(n_npus)),
        chip_name="bench",
        device_type=device_type,
        topo_affinity=frozen_map(affinity),
        topo_rows=n_npus,
        processes=(),
    )


def build_worker(n_cpus: int, n_nodes: int) -> WorkerFacts:
    return WorkerFacts(pid=1, start_time=1, allowed_cpus=frozenset(range(n_cpus)), allowed_source="status",
                       mems_allowed=frozenset(range(n_nodes)), env=frozen_map())


def measure(host, worker, targets, config, repeat, allow_warnings=False):
    make_plan(host, worker, targets, config)  # warm caches and imports
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = make_plan(host, worker, targets, config)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    make_plan(host, worker, targets, config)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert not plan.errors, plan.errors[:1]
    assert allow_warnings or not plan.warnings, plan.warnings[:1]
    return statistics.median(times) * 1000, peak / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--json", help="also write the results as JSON to this path ('-': stdout)")
    args = ap.parse_args(argv)
    rows = []
    modes = [(DeviceType.A2, "topo_affinity"), (DeviceType.A3, "global_slice"), (DeviceType.A950, "950_cluster")]
    configs = [("default", Config())]
    if "topology_policy" in Config.__dataclass_fields__:
        configs.append(("single-numa", Config(topology_policy="single-numa-node", max_numa_nodes=64)))
    header = f"{'cpus':>5} {'nodes':>5} {'npus':>4}  {'mode':<14} {'config':<11} {'targets':>7}  " \
             f"{'median ms':>9}  {'peak KiB':>8}"
    print(header)
    print("-" * len(header))
    worst = worst_aligned = 0.0
    for n_cpus, n_nodes, n_npus in SHAPES:
        for dt, label in modes:
            host = build_host(n_cpus, n_nodes, n_npus, dt)
            worker = build_worker(n_cpus, n_nodes)
            for cname, cfg in configs:
                for targets in ([n_npus // 2 + 1], list(range(n_npus))):
                    ms, kib = measure(host, worker, targets, cfg, args.repeat)
                    if (n_cpus, n_npus) == (4096, 128):
                        if cname == "default":
                            worst = max(worst, ms)
                        else:
                            worst_aligned = max(worst_aligned, ms)
                    print(f"{n_cpus:>5} {n_nodes:>5} {n_npus:>4}  {label:<14} {cname:<11} {len(targets):>7}  "
                          f"{ms:>9.2f}  {kib:>8.0f}")
                    rows.append({"cpus": n_cpus, "nodes": n_nodes, "npus": n_npus, "mode": label, "config": cname,
                                 "targets": len(targets), "median_ms": ms, "peak_kib": kib})
    host = build_host(4096, 32, 128, DeviceType.A2, every_node=True)
    for targets in ([65], list(range(128))):
        ms, kib = measure(host, build_worker(4096, 32), targets, Config(), args.repeat, allow_warnings=True)
        worst = max(worst, ms)
        print(f"{4096:>5} {32:>5} {128:>4}  {'topo (overlap)':<14} {'default':<11} {len(targets):>7}  "
              f"{ms:>9.2f}  {kib:>8.0f}")
        rows.append({"cpus": 4096, "nodes": 32, "npus": 128, "mode": "topo (overlap)", "config": "default",
                     "targets": len(targets), "median_ms": ms, "peak_kib": kib})
    verdict = "OK" if worst < TARGET_MS else "OVER"
    print(f"\n4096 CPUs / 128 NPUs, default config, slowest case: {worst:.2f} ms "
          f"(target < {TARGET_MS:.0f} ms): {verdict}")
    if worst_aligned:
        print(f"4096 CPUs / 128 NPUs, single-numa-node over 32 nodes (max_numa_nodes raised past the default 8), "
              f"slowest case: {worst_aligned:.2f} ms (informational)")
    write_json(args.json, {"bench": "plan", "params": {"repeat": args.repeat}, "target_ms": TARGET_MS,
                           "worst_ms": worst, "worst_single_numa_ms": worst_aligned or None, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
