"""What outlives the daemon process: the state file and the directory it is kept in.

state.py writes ``state_dir/state.json`` after every change (checksummed,
boot-stamped, swapped in whole) and loads it at start; staterecord.py turns a
``Binding`` into the small JSON record the file keeps and back (pure);
statedir.py refuses a ``state_dir`` another user could change. What is held is
the ``Daemon``'s to decide: this room keeps it on disk, and never changes the
host or plans.

May import: from the daemon, nothing; from the rest of ascendbind, anything but applier/ and planner/.
"""
