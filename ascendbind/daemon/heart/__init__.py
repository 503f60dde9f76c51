"""The held table and the one class that changes it.

The table is the daemon's one piece of state: pid -> the worker held there.
table.py is the table as a frozen value, and the ``Reader`` the other rooms
read it through; events.py and effects.py are what happens to it and what the
daemon must do about that, as frozen values; step.py is the table's rules, one
pure ``step(table, event) -> (table, effects)`` (who holds what, who gives way
to a bind, what a binding inherits, what a leaving worker gives back).
daemon.py is the ``Daemon``: its request entry points observe, submit events to
``step`` and keep the table it returns, under its one lock; run.py is its effect
runner, whose commit writes the state file and is the daemon's one way into
isolation's mutating side. facts.py is what a request reads of its worker and
the host before the lock; startup.py reads the state file's records back at start. The other rooms are handed the ``Daemon`` and use its
reader and its public operations; they never take its lock nor touch its
private names.

May import: from the daemon, api/, host/, isolate/, runtime/, state/ and watch/; from the rest of ascendbind, anything.
"""
