"""Where host text comes from, and the reads that hold something live.

sources.py is the ``HostSource`` pair: ``LiveHost`` runs the tools (through
command.py) and reads ``/proc`` and ``/sys``, ``SnapshotHost`` replays a
recorded directory, so everything above it runs on either. The rest read a
live host only: procdir.py holds one process's ``/proc/<pid>`` open and makes
one bounded read of a small file in it; deadline.py reads what a worker
controls on threads a request can walk away from; pin.py holds a process by
its pidfd while it is acted on; tasks.py reads the little the reconcile loop
needs of a process between binds; devnodes.py lists a worker's ``/dev`` by
lstat; kernel.py reads the kernel settings the daemon sizes itself by;
proc_connector.py is the process-events socket.

Each read hands its text to a parser of parse/ and answers values; the I/O
stops here.

May import: from discovery, parse/; from the rest of ascendbind, only values/, errors.py, command.py and
eventfd.py.
"""
