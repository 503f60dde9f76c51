"""The facts the daemon and the verbs ask for, put together from read/ and parse/.

host.py assembles the host's facts (NPUs, CPUs, NUMA) and the process table;
irqhost.py each NPU's interrupts and their masks; process.py is one
observation of a process, read once through its ``/proc/<pid>``, and
identity.py the checks on it (alive, still the same process, never pid 1, a
kernel thread or the daemon); worker.py turns that observation into the
worker's facts, deviceset.py reads the NPU evidence beside it; pages.py reads
a worker's private ranges and pagemap for the memory step; cpuusage.py what
bound workers got of their CPUs; hostwork.py and hosttasks.py what isolation
reads of the host (every IRQ and its mask, workqueues, the driver's threads,
the other tasks); snapshot.py records a live host into a directory.

Reads only: nothing here writes to the host.

May import: from discovery, parse/ and read/; from the rest of ascendbind, only values/ and errors.py.
"""
