"""The parsers: text (or bytes) in, frozen values out. Pure, by location.

Tools' output: npu_smi.py (``npu-smi info`` and its tables), lscpu.py,
columns.py + cells.py (where a printed table's columns are, and their cells),
irqbalance.py (its control protocol), kubelet.py (the CPU manager checkpoint,
and which pod and container a cgroup path names). The kernel's files:
procfs.py (``/proc`` text and ``ps -Te``), sysfs.py, irqs.py
(``/proc/interrupts``), numa_maps.py, memmap.py (``maps`` and ``pagemap``:
which pages are a process's own), mountinfo.py (which of a worker's cgroup2
mounts holds its cgroup), schedstat.py (what a thread and a CPU got),
devices.py (``/proc/devices``, ``devices.list``, the driver's process map, a
recorded ``/dev`` listing), proc_events.py (the process events as values).

Nothing here opens a file, lists a directory or runs a tool: the caller hands
the text in, so a snapshot of another host parses exactly as that host would.
tests/test_structure.py holds every module in this folder, and everything it
imports, to no ``os``, ``subprocess``, ``psutil`` or ``tomllib`` and no
``open()``; a new parser is held to that by being put here.

May import: from discovery, nothing; from the rest of ascendbind, only values/ and errors.py.
"""
