"""Isolation: the rest of the host keeps off the bound workers' CPUs.

rules/ is the pure part (held so by location): ``MaskKey`` names a mask,
records.py is what the state file keeps of each mask changed (one record type
per kind), verdicts.py the one "still ours?" rule and what follows from it for
one mask (tested as tables). kinds.py puts every kind of mask (an IRQ's, the
default IRQ mask, a workqueue's, the unbound workqueues', the watchdog's, a
thread's) behind one interface, read / apply / verify / restore; banned.py is
irqbalance's banned CPUs behind the same one. keeper.py (``Isolation``) follows
the held table: the daemon's commit calls ``Isolation.commit`` with the
bindings, the host's facts, the config and the state file's writer; it plans
the level (planner/isolate/isolation.py), records each mask before writing it,
writes it, and puts back what is no longer needed, unless its owner changed it
meanwhile. It never changes the held table. wanted.py is what each level wants
of each mask; selfmask.py keeps the daemon's own threads (and so the tools they
start) on the housekeeping CPUs. At ``host``, hosttasks.py sweeps the other
tasks (which are never moved, and where the others go) and taskwatch.py is the
thread that moves tasks started later (process events, or a listing of
``/proc``).

May import: from the daemon, state/ and runtime/; from the rest of ascendbind, anything.
"""
