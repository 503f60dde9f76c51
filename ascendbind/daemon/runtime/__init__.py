"""The daemon process's own plumbing, which every room may use.

threadname.py names each daemon thread for ``top -H`` and ``ps -L``;
stopflag.py is the stop flag a periodic loop sleeps on (one ``poll`` per wake, on
an eventfd from eventfd.py);
systemd.py speaks sd_notify and socket activation; logs.py sets up structlog
for journald, a TTY or a file. Nothing here knows of workers, NPUs or the held
table.

May import: from the daemon, nothing; from the rest of ascendbind, only eventfd.py.
"""
