"""The socket API (docs/api.md): HTTP/1.1 + JSON on a Unix stream socket.

stdlib ``http.server`` does the HTTP parsing; this module adds what a root
daemon facing local users needs:

* limits: body size (413 before reading it), a deadline for receiving the whole
  request (headers and body) so a slow client cannot hold a slot, and a bounded
  number of connections in flight (the next one gets an immediate 503);
* one response per connection (``Connection: close``): no idle keep-alives;
* every error is JSON ``{"error": CODE, "detail": "..."}``, including the ones
  http.server itself produces (bad request line, oversized headers);
* the caller's identity from SO_PEERCRED, a request id, one log line each.

The listening socket itself comes from listen.py.
"""

from __future__ import annotations

import io
import json
import re
import socket
import socketserver
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

import structlog

from .. import __version__
from ..errors import (AscendbindError, ConfigError, Conflict, DiscoveryError, NotPermitted, PlanImpossible,
                      ProcessGone, UsageError)
from .auth import Peer, peer_of
from .core import Daemon

__all__ = ["ApiServer", "http_status_of", "MAX_BODY"]

log = structlog.get_logger("ascendbind.api")

MAX_BODY = 64 * 1024
REQUEST_DEADLINE = 5.0  # seconds to receive a whole request
WRITE_TIMEOUT = 10.0
MAX_CONNECTIONS = 32
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
_ROUTES = {
    "/v1/bind": "POST",
    "/v1/release": "POST",
    "/v1/workers": "GET",
    "/v1/plan": "GET",
    "/healthz": "GET",
    "/metrics": "GET",
}


def http_status_of(exc: AscendbindError) -> int:
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return 500


class _DeadlineReader(io.RawIOBase):
    """Socket reads that share one deadline: a byte every few seconds does not reset it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received within the deadline")
        self.sock.settimeout(left)
        return self.sock.recv_into(buf)


class _SendAll(io.BufferedIOBase):
    """Unbuffered writes that send everything (a raw socket file may write short)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sock.sendall(data)
        return len(data)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ascendbind/{__version__}"
    sys_version = ""
    server: ApiServer

    # ------------------------------------------------------------ plumbing

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = io.BufferedReader(_DeadlineReader(self.request, time.monotonic() + self.server.deadline))
        self.wfile = _SendAll(self.request)
        self.peer: Peer | None = None
        try:
            self.peer = peer_of(self.request)
        except OSError:
            pass
        self.request_id = uuid.uuid4().hex[:16]
        self.responded = False
        self.t0 = time.monotonic()
        structlog.contextvars.bind_contextvars(
            request_id=self.request_id,
            peer_pid=self.peer.pid if self.peer else None,
            peer_uid=self.peer.uid if self.peer else None,
        )

    def finish(self) -> None:
        structlog.contextvars.clear_contextvars()
        try:
            self.rfile.close()
        except OSError:
            pass

    def handle(self) -> None:
        self.close_connection = True
        self.timed_out = False
        self.handle_one_request()
        if self.timed_out and not self.responded:
            self._send_json(408, {"error": "request_timeout", "detail": "the request was not received in time"})

    def address_string(self) -> str:
        return f"pid {self.peer.pid}" if self.peer else "unknown peer"

    def log_message(self, fmt, *args) -> None:  # http.server's own stderr lines
        pass

    def log_error(self, fmt, *args) -> None:
        if fmt.startswith("Request timed out"):
            self.timed_out = True
        log.info("request not completed", reason=(fmt % args)[:200])

    def send_error(self, code, message=None, explain=None) -> None:
        # http.server's HTML errors (bad request line, headers too large, ...) -> JSON
        self._send_json(int(code), {"error": "bad_http", "detail": message or explain or "malformed HTTP request"})

    def handle_expect_100(self) -> bool:
        # refuse an oversized body before the client sends it
        if self._declared_length() > MAX_BODY:
            self._too_large()
            return False
        return super().handle_expect_100()

    def _send_json(self, status: int, payload: dict, *, extra_headers: dict | None = None) -> None:
        body = (json.dumps(payload, sort_keys=False) + "\n").encode()
        self._send(status, body, "application/json", extra_headers)

    def _send(self, status: int, body: bytes, ctype: str, extra_headers: dict | None = None) -> None:
        if self.responded:
            return
        self.responded = True
        self.request.settimeout(WRITE_TIMEOUT)
        try:
            self.send_response_only(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.send_header("X-Request-Id", self.request_id)
            for k, v in (extra_headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if getattr(self, "command", "") != "HEAD":
                self.wfile.write(body)
        except OSError:
            pass  # the client went away; nothing to tell it
        path = urlsplit(getattr(self, "path", "") or "").path
        self.server.daemon.metrics.http_request(path if path in _ROUTES else "other", status)
        log.info("request", method=getattr(self, "command", None), path=path[:100], status=status,
                 ms=round((time.monotonic() - self.t0) * 1000, 1))

    def _declared_length(self) -> int:
        raw = self.headers.get("Content-Length")
        if raw is None:
            return 0
        try:
            n = int(raw)
        except ValueError:
            return -1
        return n if n >= 0 else -1

    def _too_large(self) -> None:
        self._send_json(413, {"error": "body_too_large", "detail": f"the body must be at most {MAX_BODY} bytes"})

    def _read_json(self):
        if self.headers.get("Transfer-Encoding"):
            raise _Reply(411, "length_required", "send the body with a Content-Length header")
        n = self._declared_length()
        if n < 0:
            raise _Reply(400, "bad_request", "bad Content-Length header")
        if n > MAX_BODY:
            self._too_large()
            self._drain(n)
            raise _Reply(413, "", "")
        raw = self.rfile.read(n) if n else b""
        if len(raw) < n:
            raise _Reply(400, "bad_request", "the body ended before Content-Length bytes")
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Reply(400, "bad_json", f"the body is not JSON: {exc}") from None

    def _drain(self, n: int) -> None:
        # read (a bounded amount of) what the client is still sending, so closing
        # does not reset the connection before it has read our 413
        left = min(n, 1 << 20)
        try:
            while left > 0:
                chunk = self.rfile.read1(min(left, 65536))
                if not chunk:
                    break
                left -= len(chunk)
        except (OSError, TimeoutError):
            pass

    # ------------------------------------------------------------ dispatch

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        if self.headers.get("X-Request-Id") and _REQ_ID.match(self.headers["X-Request-Id"]):
            self.request_id = self.headers["X-Request-Id"]
            structlog.contextvars.bind_contextvars(request_id=self.request_id)
        url = urlsplit(self.path)
        want = _ROUTES.get(url.path)
        daemon = self.server.daemon
        try:
            if want is None:
                raise _Reply(404, "not_found", f"no endpoint {url.path[:100]!r}; see docs/daemon.md")
            if method != want and not (method == "HEAD" and want == "GET"):
                raise _Reply(405, "method_not_allowed", f"{url.path} takes {want}", {"Allow": want})
            if self.peer is None:
                raise NotPermitted("could not read the caller's credentials (SO_PEERCRED)")
            if method == "POST":
                body = self._read_json()
            # the request is in; from here on slow work must not trip the read deadline
            self.request.settimeout(WRITE_TIMEOUT)
            if url.path == "/v1/bind":
                self._send_json(200, daemon.bind_request(self.peer, body))
            elif url.path == "/v1/release":
                self._send_json(200, daemon.release_request(self.peer, body))
            elif url.path == "/v1/workers":
                self._send_json(200, daemon.workers())
            elif url.path == "/v1/plan":
                pid, npus, policy = _plan_query(url.query)
                self._send_json(200, daemon.plan_request(self.peer, pid, npus, policy))
            elif url.path == "/healthz":
                self._send_json(200, daemon.health())
            elif url.path == "/metrics":
                self._send(200, daemon.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        except _Reply as r:
            if r.code:
                self._send_json(r.status, {"error": r.code, "detail": r.detail}, extra_headers=r.headers)
        except AscendbindError as exc:
            payload = {"error": exc.code, "detail": str(exc)}
            plan = getattr(exc, "plan", None)
            if plan is not None:
                payload["plan"] = plan.to_json()
            status = http_status_of(exc)
            if status == 500:
                log.error("request failed", error=exc.code, detail=str(exc))
            self._send_json(status, payload)
        except TimeoutError:
            self.timed_out = True
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("request crashed")
            self._send_json(500, {"error": "internal", "detail": f"{type(exc).__name__}: {exc}"[:300]})


class _Reply(Exception):
    def __init__(self, status: int, code: str, detail: str, headers: dict | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, headers


def _plan_query(query: str) -> tuple[int | None, tuple[int, ...] | None, str | None]:
    from .core import parse_bind_request

    try:
        q = parse_qs(query, keep_blank_values=False, strict_parsing=bool(query), max_num_fields=70)
    except ValueError as exc:
        raise UsageError(f"bad query string: {exc}", code="bad_request") from None
    body: dict = {}
    for key, values in q.items():
        if key not in ("pid", "npu", "topology_policy"):
            raise UsageError(f"unknown query parameter {key!r}", code="bad_request")
        if key == "topology_policy":
            body[key] = values[-1]
            continue
        try:
            ints = [int(v) for v in values]
        except ValueError:
            raise UsageError(f"query parameter {key!r} must be an integer", code="bad_request") from None
        body[key] = ints if key == "npu" else ints[-1]
    return parse_bind_request(body)


class ApiServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, sock: socket.socket, daemon: Daemon, *, max_connections: int = MAX_CONNECTIONS,
                 deadline: float = REQUEST_DEADLINE) -> None:
        super().__init__(None, _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.daemon = daemon
        self.deadline = deadline
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse_busy(request)
            return
        t = threading.Thread(target=self._serve_one, args=(request, client_address), daemon=True)
        t.start()

    def _serve_one(self, request, client_address) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse_busy(self, request) -> None:
        body = json.dumps({"error": "busy", "detail": "too many connections in flight; retry"}).encode()
        try:
            request.settimeout(0.5)
            request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Connection: close\r\nRetry-After: 1\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
        except OSError:
            pass
        self.shutdown_request(request)

    def serve(self) -> None:
        # select() without a timeout: no periodic wake-ups; stop() wakes it by connecting
        self.serve_forever(poll_interval=None)

    def stop(self) -> None:
        t = threading.Thread(target=self.shutdown, daemon=True)
        t.start()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1)
                s.connect(self.socket.getsockname())
        except OSError:
            pass
        t.join(5)
