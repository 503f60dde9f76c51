"""/metrics over TCP for Prometheus: the port, its own listener and its limits.

The port is a separate listener (listener.py) with a budget of its own, so
nothing done to it can take descriptors or threads from the API socket.
"""

from __future__ import annotations

import socket
import threading

from prometheus_client import CONTENT_TYPE_LATEST

from .listener import Conn, Limits, Listener
from .metrics import Metrics
from .wire import Request, Response, WireError, json_response

__all__ = ["MetricsListener", "start_tcp_listener", "parse_listen", "METRICS_LIMITS"]


def parse_listen(value: str) -> tuple[str, int] | None:
    """``host:port`` (``[::1]:9464`` for IPv6) -> (host, port); empty -> None (disabled)."""
    if not value:
        return None
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


# Prometheus scrapes one connection at a time; 16 open connections, 2 threads and
# short deadlines are plenty, and are this port's whole budget of descriptors and
# threads: nothing done to it can take anything from the API socket.
METRICS_LIMITS = Limits(max_total=16, per_peer=16, workers=2, line_timeout=2.0, request_timeout=5.0,
                        write_timeout=5.0, max_body=0)


class MetricsListener:
    """/metrics over TCP for Prometheus, on its own listener.Listener thread."""

    def __init__(self, addr: tuple[str, int], metrics: Metrics, *, limits: Limits = METRICS_LIMITS) -> None:
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen()
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.server_address = sock.getsockname()
        self.metrics = metrics
        self.listener = Listener(sock, limits, self._handle, identify=_tcp_peer, refused=self._refused,
                                 name="metrics")
        self._thread = threading.Thread(target=self.listener.serve, name="metrics-tcp", daemon=True)
        self._thread.start()

    def _handle(self, conn: Conn, req: Request) -> Response:
        if req.path not in ("/metrics", "/"):
            return json_response(404, {"error": "not_found", "detail": "this port serves only /metrics"})
        if req.method not in ("GET", "HEAD"):
            return json_response(405, {"error": "method_not_allowed", "detail": "/metrics takes GET, HEAD"},
                                 {"Allow": "GET, HEAD"})
        return Response(200, self.metrics.render(), CONTENT_TYPE_LATEST)

    def _refused(self, conn: Conn | None, err: WireError) -> None:
        if err.code == "busy":
            self.metrics.connection_refused("metrics")

    def stop(self) -> None:
        self.listener.stop()
        self._thread.join(5)
        self.sock.close()


def _tcp_peer(sock: socket.socket) -> tuple[None, str, bool]:
    # no uid on TCP: the address is the peer, and nobody gets root's reserve
    return None, sock.getpeername()[0], False


def start_tcp_listener(metrics: Metrics, listen: str) -> MetricsListener | None:
    """Serve /metrics on ``listen`` (host:port); None when ``listen`` is empty (disabled)."""
    addr = parse_listen(listen)
    if addr is None:
        return None
    return MetricsListener(addr, metrics)
