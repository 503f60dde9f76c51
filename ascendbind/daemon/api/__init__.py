"""The daemon's sockets, and what comes through them.

wire.py reads and writes HTTP/1.1 as bytes (pure); listener.py serves one
listening socket (connection caps per peer uid, deadlines, a bounded pool of
workers); listen.py opens the API's Unix socket or takes systemd's; auth.py
names the caller (``SO_PEERCRED``) and says whether it may touch a pid;
requests.py validates request bodies and holds the small pure rules of a bind
(policy precedence, who gives way on an NPU, a request's outcome); server.py
routes each request to the ``Daemon``; status.py answers ``GET /v1/workers``;
metrics.py keeps the Prometheus registry, metricsport.py serves it on its own
port; contention.py gathers what the workers' threads got of their CPUs
(run-queue delay, involuntary switches, CPU time, foreign load on their pools)
and the worker info series, read at scrape time.

A request changes the host only through the ``Daemon`` it is handed, never
through the applier.

May import: from the daemon, runtime/; from the rest of ascendbind, anything but applier/.
"""
