"""Discovery: what the host says, as frozen values. Three rooms, one way down:

* parse/   pure: text (or bytes) in, frozen values out. No I/O, by location:
           tests/test_structure.py holds every module here, and all it
           imports, to touching nothing on the host;
* read/    the edge: where host text comes from (``LiveHost`` runs the tools
           and reads ``/proc`` and ``/sys``, ``SnapshotHost`` replays a
           directory) and the reads that hold something live: one
           ``/proc/<pid>`` directory, a pidfd, a deadline, the events socket;
* gather/  the facts the daemon and the verbs ask for, put together from
           read/'s reads and parse/'s parsers: the host's, a worker's, the
           NPU evidence, isolation's view of the host, a snapshot.

gather/ imports read/ and parse/, read/ imports parse/, parse/ imports
neither. A new parser goes into parse/ and nowhere else; a pair such as
parse/irqs.py and gather/irqhost.py says by its folders which half reads.
"""

from .gather.host import discover_cpu_topology, discover_host, discover_processes, pci_address_of
from .gather.irqhost import discover_npu_irqs
from .gather.worker import discover_worker
from .read.sources import HostSource, LiveHost, SnapshotHost

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
