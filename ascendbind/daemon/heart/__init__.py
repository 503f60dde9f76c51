"""The held table and the one class that changes it.

The table is the daemon's one piece of state: pid -> the worker held there.
daemon.py is the ``Daemon``: the request entry points (bind, release, plan) and
the table's keeping (restore at start, liveness, drop, a look's actions, the
memory and re-plan bookkeeping), the only code that changes the table or a
record in it, under its one lock. The other rooms are handed the ``Daemon`` and
call its public operations; they never take its lock nor touch its private
names.

May import: from the daemon, api/, host/, isolate/, runtime/, state/ and watch/; from the rest of ascendbind, anything.
"""
