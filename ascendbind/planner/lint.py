"""Config lint: settings that contradict each other or do nothing on this host.

After Koordinator's "tension points": the combinations are legal,
so they are never errors, but an operator should hear about them once at
start-up and in ``plan --explain``. Pure: config + host facts in, sentences out.
"""

from __future__ import annotations

from ..values.config import Config
from ..values.model import DeviceType, HostFacts, Mode
from .pools.layout import Layout
from .plan import choose_mode, effective_device_type
from .align.policy import cpu_bind_policy, topology_policy

__all__ = ["lint_config"]


def lint_config(config: Config, host: HostFacts) -> list[str]:
    out: list[str] = []
    device_type = effective_device_type(host, config)
    mode, _ = choose_mode(device_type, host)
    policy = topology_policy(config.topology_policy)
    layout = Layout.build(host, ())
    nodes = sorted(set(host.numa_nodes) | set(layout.nodes))

    if policy.strict and mode is Mode.TOPO_AFFINITY and config.numa_extension != "none":
        out.append(
            f"numa_extension = {config.numa_extension} does nothing under topology_policy = {policy.name}: an admitted "
            f"pool is built inside one NUMA node without extension, and a refused NPU gets no pool")
    if "numa_extension" in config.explicit and config.numa_extension != "next" and mode is not Mode.TOPO_AFFINITY:
        out.append(
            f"numa_extension = {config.numa_extension} does nothing on this host: {mode.value} never extends pools")
    if config.numa_extension == "closest" and mode is Mode.TOPO_AFFINITY and not layout.has_distances():
        out.append("numa_extension = closest needs NUMA distances (/sys/devices/system/node/node*/distance), which "
                   "this host does not report; pools are extended to the next node instead")
    if policy.strict and config.small_pool == "share":
        out.append(
            f"small_pool = share under topology_policy = {policy.name} admits pools whose roles share CPUs: a node that "
            f"gives an NPU fewer CPUs than the role split needs still counts as aligned")
    if cpu_bind_policy(config.cpu_bind_policy).whole_cores:
        if host.threads_per_core == 1:
            out.append("cpu_bind_policy = full-pcpus is a no-op on this host: lscpu reports 1 thread per core")
        elif not any(c.core is not None for c in host.cpus):
            out.append("cpu_bind_policy = full-pcpus is a no-op on this host: lscpu -e has no CORE column, so SMT "
                       "siblings are unknown")
    if config.prefer_closest_numa:
        if policy.prefers_single_node:
            out.append(f"prefer_closest_numa = true has no effect under topology_policy = {policy.name}: every "
                       "candidate is one node (kubelet ignores it there too)")
        elif not layout.has_distances():
            out.append("prefer_closest_numa = true has no effect: this host reports no NUMA distances")
        elif not policy.aligns and "prefer_closest_numa" in config.explicit:
            out.append(f"prefer_closest_numa = true only changes the reported alignment under topology_policy = "
                       f"{policy.name}")
    if policy.aligns:
        if len(nodes) > config.max_numa_nodes:
            out.append(f"topology_policy = {policy.name} refuses every NPU on this host: it has {len(nodes)} NUMA nodes, "
                       f"above max_numa_nodes = {config.max_numa_nodes}")
        elif len(nodes) == 1:
            out.append(f"topology_policy = {policy.name} has nothing to choose on this host: it has one NUMA node")
    if device_type is DeviceType.A950 and "irq_binding" in config.explicit and not config.irq_binding:
        out.append("irq_binding = false changes nothing on Ascend 950: IRQ binding is always skipped there")
    if device_type is DeviceType.A950 and "small_pool" in config.explicit and config.small_pool == "share":
        out.append("small_pool = share changes nothing on Ascend 950: each NPU gets a whole cluster or nothing")
    return out
