"""HTTP/1.1 requests and responses as bytes: a strict reader with no I/O.

The daemon answers local, possibly hostile, clients, so it reads less of HTTP
than a general server and says no early:

* one request per connection; every answer is a status line, ``Content-Type``,
  ``Content-Length``, ``Connection: close`` and a body (JSON for every error);
* the request line is ``METHOD SP origin-form SP HTTP/1.x`` (absolute-form is
  accepted for the path); another well-formed version is 505, anything else
  400 (there is no HTTP/0.9 answer without a status line);
* a method is a case-sensitive token: one the endpoint does not take, or one
  no endpoint takes (``OPTIONS``, ``TRACE``, ``get``), is 405 with ``Allow``,
  which the caller decides; this module only checks the token syntax;
* the head ends with an empty line: the end of input before it, or before
  ``Content-Length`` body bytes, is 400 and the request is never handed on;
* caps: ``MAX_LINE`` for the request line, ``MAX_HEAD`` for the whole head,
  ``MAX_HEADERS`` header fields, ``max_body`` body bytes (413 before the body
  is read); a body needs ``Content-Length`` (``Transfer-Encoding`` is 411, and
  400 together with ``Content-Length``: the pair is how requests get smuggled);
  conflicting ``Content-Length`` values, obsolete line folding, whitespace
  before a colon, control characters and non-ASCII in the request line are 400.

``RequestReader.feed`` takes whatever bytes arrived and returns the complete
``Request`` once there is one; errors are ``WireError`` values carrying the
status and a reason code. Deadlines are the caller's: ``line_done`` says
whether the request line is in, which is what the short first deadline waits for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["Request", "Response", "WireError", "RequestReader", "render_response", "json_response",
           "MAX_LINE", "MAX_HEAD", "MAX_HEADERS", "CONTINUE"]

MAX_LINE = 8 * 1024
MAX_HEAD = 16 * 1024
MAX_HEADERS = 64
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_DIGITS = re.compile(rb"[0-9]{1,20}")

REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 411: "Length Required",
    413: "Content Too Large", 422: "Unprocessable Content", 503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class WireError(Exception):
    """A request that will not be handed on: answer ``status`` with ``{"error": code, ...}``."""

    def __init__(self, status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail
        self.headers = headers or {}


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    path: str
    query: str
    version: str
    headers: tuple[tuple[str, str], ...]  # (lower-case name, value) in arrival order
    body: bytes = b""

    def header(self, name: str) -> str | None:
        """The last value of ``name`` (case-insensitive), or None."""
        name = name.lower()
        found = None
        for k, v in self.headers:
            if k == name:
                found = v
        return found


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(status: int, payload: dict, headers: dict[str, str] | None = None) -> Response:
    return Response(status, (json.dumps(payload) + "\n").encode(), "application/json", dict(headers or {}))


def error_response(err: WireError) -> Response:
    return json_response(err.status, {"error": err.code, "detail": err.detail}, err.headers)


def render_response(resp: Response, *, request_id: str = "", head_only: bool = False) -> bytes:
    """The bytes on the wire: status line, fixed headers, the body (omitted for HEAD)."""
    lines = [f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, 'Unknown')}",
             f"Content-Type: {resp.content_type}",
             f"Content-Length: {len(resp.body)}",
             "Connection: close"]
    if request_id:
        lines.append(f"X-Request-Id: {request_id}")
    for k, v in resp.headers.items():
        lines.append(f"{k}: {v}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + resp.body


def _bad(detail: str, code: str = "bad_http") -> WireError:
    return WireError(400, code, detail)


def _request_line(line: bytes) -> tuple[str, str, str, str, str]:
    parts = line.split(b" ")
    if len(parts) != 3:
        raise _bad("the request line must be METHOD SP TARGET SP HTTP-VERSION")
    method, target, version = parts
    m = _VERSION.fullmatch(version)
    if m is None:
        raise _bad("malformed HTTP version in the request line")
    if m.group(1) != b"1":
        raise WireError(505, "http_version_not_supported",
                        f"HTTP/{m.group(1).decode()}.{m.group(2).decode()} is not served; use HTTP/1.1 or HTTP/1.0")
    if not _TOKEN.fullmatch(method):
        raise _bad("the method is not an HTTP token")
    if not _TARGET.fullmatch(target):
        raise _bad("the request target holds spaces, control characters or non-ASCII bytes")
    text = target.decode("ascii")
    if text.startswith("/"):
        path, _, query = text.partition("?")
        path = path.partition("#")[0]
    elif text.startswith(("http://", "https://")):
        try:
            url = urlsplit(text)
        except ValueError:
            raise _bad("malformed absolute request target") from None
        path, query = url.path or "/", url.query
    else:
        raise _bad("the request target must be a path starting with '/'")
    return method.decode("ascii"), text, path, query, version.decode("ascii")


def _header_fields(lines: list[bytes]) -> tuple[tuple[str, str], ...]:
    if len(lines) > MAX_HEADERS:
        raise _bad(f"more than {MAX_HEADERS} header fields")
    out = []
    for raw in lines:
        if raw[:1] in (b" ", b"\t"):
            raise _bad("obsolete header line folding is not accepted")
        name, sep, value = raw.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            raise _bad("malformed header field (a name, a colon, a value; no space before the colon)")
        value = value.strip(b" \t")
        if not _FIELD_VALUE.fullmatch(value):
            raise _bad("control characters in a header value")
        out.append((name.decode("ascii").lower(), value.decode("latin-1")))
    return tuple(out)


def _body_length(headers: tuple[tuple[str, str], ...], max_body: int) -> int:
    lengths = {v for k, v in headers if k == "content-length"}
    chunked = any(k == "transfer-encoding" for k, _ in headers)
    if chunked and lengths:
        raise _bad("both Transfer-Encoding and Content-Length: refused")
    if chunked:
        raise WireError(411, "length_required", "send the body with a Content-Length header, not chunked")
    if not lengths:
        return 0
    if len(lengths) > 1:
        raise _bad("conflicting Content-Length headers")
    raw = lengths.pop().encode("latin-1")
    if not _DIGITS.fullmatch(raw):
        raise _bad("Content-Length must be a decimal number of bytes")
    n = int(raw)
    if n > max_body:
        raise WireError(413, "body_too_large", f"the body must be at most {max_body} bytes")
    return n


class RequestReader:
    """Incremental reader of one request; ``feed`` returns it once it is complete."""

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.buf = bytearray()
        self.line_done = False
        self.head: tuple | None = None  # (method, target, path, query, version, headers)
        self.length = 0
        self.wants_continue = False  # the head asked for "100 Continue" and no body byte is here yet

    def feed(self, data: bytes) -> Request | None:
        self.buf += data
        if self.head is None:
            self._read_head()
            if self.head is None:
                return None
        if len(self.buf) < self.length:
            return None
        self.wants_continue = False
        method, target, path, query, version, headers = self.head
        return Request(method, target, path, query, version, headers, bytes(self.buf[:self.length]))

    def feed_eof(self) -> WireError:
        """The peer ended its side before a whole request: what to answer."""
        if self.head is None:
            return _bad("the connection ended before the request head was complete", "incomplete_request")
        return _bad(f"the connection ended after {len(self.buf)} of {self.length} body bytes", "incomplete_request")

    def _read_head(self) -> None:
        # an empty line or two before the request line is tolerated (stray CRLF of a previous request)
        while self.buf[:1] == b"\n" or self.buf[:2] == b"\r\n":
            del self.buf[:1 if self.buf[:1] == b"\n" else 2]
        if not self.line_done:
            nl = self.buf.find(b"\n")
            if nl < 0:
                if len(self.buf) > MAX_LINE:
                    raise _bad(f"the request line is longer than {MAX_LINE} bytes")
                return
            if nl > MAX_LINE:
                raise _bad(f"the request line is longer than {MAX_LINE} bytes")
            _request_line(bytes(self.buf[:nl]).removesuffix(b"\r"))  # fail fast on a bad line
            self.line_done = True
        m = _HEAD_END.search(self.buf)
        if m is None:
            if len(self.buf) > MAX_HEAD:
                raise _bad(f"the request head is larger than {MAX_HEAD} bytes")
            return
        if m.start() > MAX_HEAD:
            raise _bad(f"the request head is larger than {MAX_HEAD} bytes")
        lines = [ln.removesuffix(b"\r") for ln in bytes(self.buf[:m.start()]).split(b"\n")]
        del self.buf[:m.end()]
        method, target, path, query, version = _request_line(lines[0])
        headers = _header_fields(lines[1:])
        self.length = _body_length(headers, self.max_body)
        self.head = (method, target, path, query, version, headers)
        expect = [v.lower() for k, v in headers if k == "expect"]
        if expect and expect != ["100-continue"]:
            raise WireError(400, "bad_http", "only 'Expect: 100-continue' is understood")
        self.wants_continue = bool(expect) and self.length > len(self.buf) and version == "HTTP/1.1"
