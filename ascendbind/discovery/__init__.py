"""Discovery: host text -> frozen facts. Pure parsers plus the HostSource edge."""

from .host import discover_cpu_topology, discover_host, discover_processes, pci_address_of
from .irqhost import discover_npu_irqs
from .sources import HostSource, LiveHost, SnapshotHost
from .worker import discover_worker

__all__ = [
    "discover_host",
    "discover_worker",
    "discover_processes",
    "discover_cpu_topology",
    "pci_address_of",
    "discover_npu_irqs",
    "HostSource",
    "LiveHost",
    "SnapshotHost",
]
