"""The socket API: HTTP/1.1 + JSON on a Unix stream socket.

wire.py reads the bytes, listener.py owns the connections (caps per peer uid,
capacity kept for root, deadlines, a bounded worker pool); this module is the
part that knows the endpoints: route, method (405 with ``Allow``), the caller
from SO_PEERCRED, the JSON body, the daemon call, and one JSON answer with a
request id and one log line.

No request ends in a 5xx other than 503 and 505: every daemon error maps to
its status, and an exception nobody expected is still answered (503
``internal_error``), logged as an error event naming the exception and where it
was raised, and counted in ``ascendbind_http_internal_errors_total``, so a bug
costs one request, never a traceback in the journal or the daemon.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import traceback
from urllib.parse import parse_qs

import structlog

from ...discovery.read.tasks import pid_namespace
from ...errors import (AscendbindError, ConfigError, Conflict, DiscoveryError, NotPermitted, PlanImpossible,
                       ProcessGone, UsageError)
from .auth import Peer, peer_of
from .listener import Conn, Limits, Listener
from .metrics import BindClock
from .requests import decode_json_body, parse_bind_request
from .wire import Request, Response, WireError, error_response, json_response

__all__ = ["ApiServer", "http_status_of", "API_LIMITS", "MAX_BODY", "ROUTES"]

log = structlog.get_logger("ascendbind.api")

MAX_BODY = 64 * 1024
# File descriptors: 128 connections at most; uid 0 alone may use the last 32,
# one other uid at most 16. Threads: 6 for everyone, of which one uid holds at most 2 at
# once (its other requests wait their turn behind other uids'), plus 4 that serve root only,
# of which root in one PID namespace (the host's, or a container's) holds at most 2.
# /healthz needs no thread: the loop answers it.
API_LIMITS = Limits(max_total=128, per_peer=16, root_reserve=32, workers=6, peer_workers=2, root_workers=4,
                    root_peer_workers=2,
                    line_timeout=2.0, request_timeout=5.0, write_timeout=5.0, max_body=MAX_BODY)
_REQ_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

_STATUS = (
    (UsageError, 400),
    (ConfigError, 400),
    (NotPermitted, 403),
    (ProcessGone, 404),
    (Conflict, 409),
    (PlanImpossible, 422),
    (DiscoveryError, 503),
)
ROUTES = {
    "/v1/bind": "POST",
    "/v1/release": "POST",
    "/v1/workers": "GET",
    "/v1/plan": "GET",
    "/healthz": "GET",
    "/metrics": "GET",
}


def http_status_of(exc: AscendbindError) -> int:
    """The status of a daemon error; one outside the mapped kinds is 503 (never another 5xx)."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return 503


def allowed_methods(path: str) -> str:
    want = ROUTES[path]
    return "GET, HEAD" if want == "GET" else want


def _plan_query(query: str):
    try:
        q = parse_qs(query, keep_blank_values=False, strict_parsing=bool(query), max_num_fields=70)
    except ValueError as exc:
        raise UsageError(f"bad query string: {str(exc)[:100]}", code="bad_request") from None
    body: dict = {}
    for key, values in q.items():
        if key not in ("pid", "npu", "device_index", "topology_policy", "pool_source"):
            raise UsageError(f"unknown query parameter {key[:40]!r}", code="bad_request")
        if key in ("topology_policy", "pool_source"):
            body[key] = values[-1]
            continue
        if not all(v.isascii() and v.isdigit() and len(v) <= 12 for v in values):
            raise UsageError(f"query parameter {key!r} must be a decimal integer", code="bad_request")
        ints = [int(v) for v in values]
        body[key] = ints if key == "npu" else ints[-1]
    return parse_bind_request(body)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.rpartition('/')[2]}:{f.lineno} in {f.name}"


class ApiServer:
    """The API on ``sock`` (already bound and listening): ``serve()`` blocks, ``stop()`` ends it.
    Each request is handed to ``daemon``, the ``Daemon`` (heart/daemon.py) that alone changes what it holds."""

    def __init__(self, sock: socket.socket, daemon, *, limits: Limits = API_LIMITS) -> None:
        self.daemon = daemon
        self.listener = Listener(sock, limits, self._handle, identify=_identify, refused=self._refused, name="api",
                                 inline=_answered_on_the_loop, share_key=_share_key)
        self._busy_lock = threading.Lock()
        self._busy_since_log = 0
        self._busy_logged_at = -60.0

    def serve(self) -> None:
        self.listener.serve()

    def stop(self) -> None:
        self.listener.stop()

    # ------------------------------------------------------------ answers the loop made

    def _refused(self, conn: Conn | None, err: WireError) -> None:
        self.daemon.metrics.http_request("other", err.status)
        if err.code == "busy":
            self.daemon.metrics.connection_refused("api")
            self._log_busy()
            return
        peer = conn.peer if conn is not None else None
        log.info("request not completed", request_id=conn.id if conn else None, status=err.status, error=err.code,
                 detail=err.detail, peer_pid=getattr(peer, "pid", None), peer_uid=getattr(peer, "uid", None))

    def _log_busy(self) -> None:
        # one line per 10 s at most: a flood of refusals must not become a flood of log lines
        now = time.monotonic()
        with self._busy_lock:
            self._busy_since_log += 1
            if now - self._busy_logged_at < 10.0:
                return
            n, self._busy_since_log, self._busy_logged_at = self._busy_since_log, 0, now
        log.warning("connections refused: too many open", refused=n, open=self.listener.open_connections())

    # ------------------------------------------------------------ requests

    def _handle(self, conn: Conn, req: Request) -> Response:
        t0 = time.monotonic()
        rid = req.header("x-request-id")
        if rid and _REQ_ID.match(rid):
            conn.id = rid
        peer: Peer | None = conn.peer  # type: ignore[assignment]
        structlog.contextvars.bind_contextvars(request_id=conn.id, peer_pid=peer.pid if peer else None,
                                               peer_uid=peer.uid if peer else None)
        try:
            resp = self._route(conn, peer, req)
        except WireError as err:
            resp = error_response(err)
        except Exception as exc:  # noqa: BLE001 - the last resort: answer, log, count; never a traceback
            self.daemon.metrics.http_internal_error()
            log.error("request failed unexpectedly", exception=type(exc).__name__, detail=str(exc)[:300],
                      where=_where(exc), method=req.method[:16], path=req.path[:100])
            resp = json_response(503, {"error": "internal_error",
                                       "detail": f"the daemon failed on this request ({type(exc).__name__}); "
                                                 "it is logged and counted"})
        path = req.path if req.path in ROUTES else "other"
        self.daemon.metrics.http_request(path, resp.status)
        log.info("request", method=req.method[:16], path=req.path[:100], status=resp.status,
                 ms=round((time.monotonic() - t0) * 1000, 1))
        structlog.contextvars.clear_contextvars()
        return resp

    def _route(self, conn: Conn, peer: Peer | None, req: Request) -> Response:
        want = ROUTES.get(req.path)
        if want is None:
            return json_response(404, {"error": "not_found",
                                       "detail": f"no endpoint {req.path[:100]!r}; see docs/daemon.md"})
        method = "GET" if req.method == "HEAD" else req.method
        if method != want:
            allow = allowed_methods(req.path)
            return json_response(405, {"error": "method_not_allowed", "detail": f"{req.path} takes {allow}"},
                                 {"Allow": allow})
        try:
            if peer is None:
                raise NotPermitted("could not read the caller's credentials (SO_PEERCRED)")
            return self._call(conn, peer, req)
        except AscendbindError as exc:
            payload = {"error": exc.code, "detail": str(exc)}
            plan = getattr(exc, "plan", None)
            if plan is not None:
                payload["plan"] = plan.to_json()
            evidence = getattr(exc, "evidence", None)
            if evidence:
                payload["evidence"] = [e.to_json() for e in evidence]
            status = http_status_of(exc)
            if status == 503 and not isinstance(exc, DiscoveryError):
                log.error("request failed", error=exc.code, detail=str(exc)[:300])
            return json_response(status, payload)

    def _call(self, conn: Conn, peer: Peer, req: Request) -> Response:
        daemon = self.daemon
        if req.path == "/v1/bind":
            return self._bind(conn, peer, req)
        if req.path == "/v1/release":
            return json_response(200, daemon.release_request(peer, decode_json_body(req.body)))
        if req.path == "/v1/workers":
            return json_response(200, daemon.workers(req.query, peer))
        if req.path == "/v1/plan":
            pid, target, policy = _plan_query(req.query)
            return json_response(200, daemon.plan_request(peer, pid, target, policy))
        if req.path == "/healthz":
            return json_response(200, daemon.health())
        return Response(200, daemon.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    def _bind(self, conn: Conn, peer: Peer, req: Request) -> Response:
        """POST /v1/bind, timed phase by phase (ascendbind_bind_phase_seconds_total): the clock
        takes the credentials' time from accept and stops once the answer is sent (or its
        sending failed); what waits for the answer starts then."""
        clock = BindClock()
        clock.spent["peer"] = conn.identified_in
        later: list = []
        try:
            resp = json_response(200, self.daemon.bind_request(peer, decode_json_body(req.body), clock=clock,
                                                               later=later))
        except BaseException:
            for work in later:  # queued before the bind failed (the loop's poke): not lost with it
                work()
            raise
        metrics = self.daemon.metrics

        def sent() -> None:
            clock.mark("answer")
            metrics.bind_phases(clock.spent)
            for work in later:  # what waits for the answer (the named NPU's check)
                work()

        conn.after_send = sent
        return resp


def _answered_on_the_loop(req: Request) -> bool:
    # the liveness probe reads no lock and no file: it never waits for a thread
    return req.path == "/healthz"


def _share_key(conn: Conn):
    """Whose share of the threads a request uses: its uid; for root, root in its PID
    namespace, so a container running as uid 0 cannot take the host root's threads.
    (Other uids are not split further: any user can make PID namespaces at will.)"""
    if not conn.is_root or conn.peer is None:
        return conn.key
    return 0, pid_namespace(conn.peer.pid)


def _identify(sock: socket.socket) -> tuple[Peer, int, bool]:
    peer = peer_of(sock)
    return peer, peer.uid, peer.uid == 0
