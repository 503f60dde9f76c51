"""The daemon: binds workers on request, and keeps them bound.

Its one piece of state is the held table (pid -> ``Held``). heart/ holds it:
the ``Daemon``, the only code that changes the table or a record in it, under
its one lock. runtime/serve.py is the process: it opens the sockets, starts
every thread and stops them.

Around them, the rooms; each one's ``__init__`` says what it owns and what it
may import, and tests/test_structure.py holds every module to that:

* heart/    the held table and the ``Daemon`` that changes it;
* runtime/  the process: serve.py, and its plumbing (thread names, the stop
            flag, systemd, logs);
* state/    the state file, its records and its directory;
* api/      the sockets and what comes through them;
* watch/    keeping bound workers bound: the lifecycle rules and the loops
            around them;
* host/     the host's facts, and binding again when they change;
* isolate/  the rest of the host off the bound workers' CPUs, and back.

runtime/'s plumbing and state/ import no other room; api/ imports runtime/;
watch/ and host/ import runtime/ and the request rules of api/requests.py,
watch/ the state room too; isolate/ imports state/ and runtime/. No room
imports heart/: a room is handed the ``Daemon`` and calls its public
operations. heart/ may import any room, runtime/serve.py anything.
"""
