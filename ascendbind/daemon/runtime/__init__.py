"""The daemon process's own plumbing, which every room may use.

threadname.py names each daemon thread for ``top -H`` and ``ps -L``;
stopflag.py is the stop flag a periodic loop sleeps on (one ``poll`` per wake, on
an eventfd from eventfd.py);
systemd.py speaks sd_notify and socket activation; logs.py sets up structlog
for journald, a TTY or a file. Those know nothing of workers, NPUs or the held
table, and import no other room (tests/test_structure.py holds them to it).

serve.py is the process itself (``ascendbind serve``): it builds the
``Daemon``, opens the sockets, starts every thread and stops them, so it alone
here imports every room and the rest of the package.

May import: from the daemon, api/, heart/, host/, isolate/, state/ and watch/; from the rest of ascendbind, anything.
"""
