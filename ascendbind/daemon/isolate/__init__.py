"""Isolation: the rest of the host keeps off the bound workers' CPUs.

rules.py is what isolation does to one mask, given what it saved, what the mask
holds now and what it wants (pure, tested as a table); selfmask.py keeps the
daemon's own threads (and so the tools they start) on the housekeeping CPUs;
keeper.py follows the held table: after every change it plans the levels
(planner/isolate/isolation.py), records each mask in the state file before writing it,
writes it, and puts back what is no longer needed, unless its owner changed it
meanwhile. The ``Daemon`` calls it; it never changes the held table. masks.py
reads and writes each kind of mask; banned.py tells irqbalance. At ``host``,
hosttasks.py sweeps the other tasks (which are never moved, and where the
others go) and taskwatch.py is the thread that moves tasks started later
(process events, or a listing of ``/proc``).

May import: from the daemon, state/ and runtime/; from the rest of ascendbind, anything.
"""
