"""Client of the ascendbind daemon: stdlib only, so a worker can import it.

    from ascendbind.client import Client
    Client().bind(npu=3)            # bind this very process (pid taken from SO_PEERCRED)
    Client().bind(device_index=0)   # ... to the NPU behind its runtime's device 0 (the daemon resolves it)
    Client().bind()                 # ... to what the evidence about it says (its container's devices ...)
    Client().bind(pid=1234, npu=3)  # bind another process (root, or your own descendant)
    Client().release(pid=1234); Client().workers(); Client().plan(npu=3); Client().health()
    Client().worker(1234, explain=True)  # one bound worker, with its plan explanation

API errors are raised as ascendbind.errors exceptions (also stdlib only), whose
``exit_status`` is the CLI's exit status (docs/cli.md): 400 -> 2, 403 -> 7, 404 -> 6, 409 -> 9,
413 -> 2, 422 -> 3, 503 -> 5, socket absent / nobody answering -> 4. The
exception carries ``status`` (HTTP) and ``payload`` (the JSON body).

``run_bound`` is ``ascendbind run``: fork; the child asks the daemon to bind
*itself* (so it works from inside a container's pid namespace), prefers its
pool's NUMA node(s) for its memory (mempolicy.py), then execs the command; the
parent forwards signals and returns the command's status.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from urllib.parse import urlencode

from . import errors
from .values.config import DEFAULT_SOCKET
from .mempolicy import prefer_nodes
from .settings import resolve_socket

__all__ = ["Client", "DEFAULT_SOCKET", "default_socket", "run_bound", "FORWARDED_SIGNALS"]

_BY_STATUS = {
    400: errors.UsageError,
    403: errors.NotPermitted,
    404: errors.ProcessGone,
    409: errors.Conflict,
    411: errors.UsageError,
    413: errors.UsageError,
    422: errors.PlanImpossible,
    503: errors.DiscoveryError,
}


def default_socket() -> str:
    """The socket a Client without one uses: the same answer the CLI's verbs get
    (``ASCENDBIND_SOCKET``, else the config file's ``socket``, else the default)."""
    return resolve_socket()


# the daemon's answers: a head of a few hundred bytes, a body up to the size of
# /metrics or /v1/workers on a big host; anything larger is not the daemon talking
MAX_HEAD = 64 * 1024
MAX_ANSWER = 32 * 1024 * 1024
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?")


class BadAnswer(Exception):
    """The bytes that came back are not an answer this client takes."""


def _recv_some(sock: socket.socket, deadline: float, what: str) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no complete answer in time ({what})")
    sock.settimeout(left)
    return sock.recv(65536)


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """(status, lower-case header -> last value) of an answer head (without its blank
    line); BadAnswer when it is not one the daemon sends: a status line, header fields,
    one ``Content-Length``, no ``Transfer-Encoding``."""
    lines = head.split(b"\r\n")
    m = _STATUS_LINE.fullmatch(lines[0])
    if m is None:
        raise BadAnswer(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(m.group(1))
    if status < 200:
        raise BadAnswer(f"an interim {status} answer to a request that asked for none")
    headers: dict[str, str] = {}
    lengths = set()
    for raw in lines[1:]:
        name, sep, value = raw.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadAnswer(f"malformed header field {raw[:80]!r}")
        key, text = name.decode("latin-1").lower(), value.strip().decode("latin-1")
        if key == "content-length":
            lengths.add(text)
        headers[key] = text
    if "transfer-encoding" in headers:
        raise BadAnswer(f"Transfer-Encoding {headers['transfer-encoding'][:40]!r}: the daemon sends lengths")
    if len(lengths) != 1:
        raise BadAnswer("no Content-Length" if not lengths else "conflicting Content-Length headers")
    text = lengths.pop()
    if not text.isdigit() or len(text) > 12:
        raise BadAnswer(f"Content-Length {text[:20]!r} is not a byte count")
    return status, headers


def exchange(path: str, request: bytes, timeout: float, *, max_answer: int = MAX_ANSWER) -> tuple[int, str, bytes]:
    """Send one request on the Unix socket ``path``; (status, Content-Type, body) of the answer.

    One connection, one request, one answer (the daemon closes after each): the
    head up to its blank line, then exactly ``Content-Length`` body bytes. The whole
    exchange, connect included, gets ``timeout`` seconds; an answer larger than
    ``max_answer``, chunked, without a length or cut short raises BadAnswer. OSError
    (TimeoutError included) as the socket raises it."""
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            # a daemon out of room answers 503 at accept and closes without reading:
            # the answer may be waiting all the same
            pass
        buf = b""
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > MAX_HEAD:
                raise BadAnswer(f"an answer head larger than {MAX_HEAD} bytes")
            chunk = _recv_some(sock, deadline, "head")
            if not chunk:
                raise BadAnswer("the connection closed before an answer" if not buf
                                else "the connection closed in the middle of the answer head")
            buf += chunk
        status, headers = parse_head(buf[:end])
        length = int(headers["content-length"])
        if length > max_answer:
            raise BadAnswer(f"an answer of {length} bytes (at most {max_answer} taken)")
        body = bytearray(buf[end + 4:])
        while len(body) < length:
            chunk = _recv_some(sock, deadline, "body")
            if not chunk:
                raise BadAnswer(f"the connection closed after {len(body)} of {length} body bytes")
            body += chunk
        if len(body) > length:
            raise BadAnswer(f"{len(body) - length} bytes beyond the Content-Length")
        return status, headers.get("content-type", ""), bytes(body)
    finally:
        sock.close()


def render_request(method: str, path: str, data: bytes | None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
    if data is None:
        return (head + "\r\n").encode("ascii")
    return (head + f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode("ascii") + data


class Client:
    def __init__(self, socket_path: str | None = None, *, timeout: float = 120.0,
                 max_answer: int = MAX_ANSWER) -> None:
        self.socket_path = socket_path or default_socket()
        self.timeout = timeout  # seconds for a whole request: connect, send, the answer
        self.max_answer = max_answer

    # ------------------------------------------------------------ transport

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
        data = None if body is None else json.dumps(body).encode()
        try:
            status, ctype, raw = exchange(self.socket_path, render_request(method, path, data), self.timeout,
                                          max_answer=self.max_answer)
        except PermissionError:
            raise errors.NotPermitted(
                f"permission denied on {self.socket_path}: ask for the daemon's socket group"
            ) from None
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise errors.DaemonUnreachable(
                f"no ascendbind daemon on {self.socket_path} ({exc.strerror}); is `ascendbind serve` running?"
            ) from None
        except (TimeoutError, socket.timeout):  # one class from 3.10, two before
            raise errors.DaemonUnreachable(
                f"ascendbind daemon on {self.socket_path} did not answer within {self.timeout:g} s") from None
        except BadAnswer as exc:
            raise errors.DaemonUnreachable(f"unexpected answer from {self.socket_path}: {exc}") from None
        except OSError as exc:
            raise errors.DaemonUnreachable(f"ascendbind daemon on {self.socket_path} did not answer: {exc}") from None
        if ctype.startswith("application/json"):
            try:
                payload: dict | str = json.loads(raw)
            except ValueError:
                payload = raw.decode("utf-8", "replace")
        else:
            payload = raw.decode("utf-8", "replace")
        if status >= 400:
            raise _api_error(status, payload)
        return status, payload

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        _status, payload = self.request(method, path, body)
        if not isinstance(payload, dict):
            raise errors.DaemonUnreachable(f"unexpected answer from the daemon: {str(payload)[:200]}")
        return payload

    # ------------------------------------------------------------ API

    def bind(self, pid: int | None = None, npu: int | Sequence[int] | None = None,
             topology_policy: str | None = None, *, device_index: int | None = None,
             env: dict[str, str] | None = None, pool_source: str | None = None) -> dict:
        """Bind ``pid`` (None: this process) to ``npu``, or to the NPU behind the worker's runtime
        ``device_index``, or (neither) to what the evidence about the worker says. ``env``: the
        ASCEND_* variables the worker sees now, which the daemon prefers to its start-up environment.
        ``topology_policy`` and ``pool_source``: what the request asks of its plan (None: the node's)."""
        body: dict = {}
        if pid is not None:
            body["pid"] = pid
        if npu is not None:
            body["npu"] = npu if isinstance(npu, int) else list(npu)
        if device_index is not None:
            body["device_index"] = device_index
        if env is not None:
            body["env"] = dict(env)
        if topology_policy is not None:
            body["topology_policy"] = topology_policy
        if pool_source is not None:
            body["pool_source"] = pool_source
        return self._json("POST", "/v1/bind", body)

    def release(self, pid: int | None = None, *, all: bool = False) -> dict:
        body: dict = {"all": True} if all else ({"pid": pid} if pid is not None else {})
        return self._json("POST", "/v1/release", body)

    def workers(self) -> dict:
        return self._json("GET", "/v1/workers")

    def worker(self, pid: int, *, explain: bool = False) -> dict:
        """One bound worker's record (ProcessGone ``not_bound`` when the daemon does not hold it);
        ``explain`` adds ``explanation``, the text of ``plan --explain`` for its plan."""
        q = urlencode([("pid", pid)] + ([("explain", 1)] if explain else []))
        return self._json("GET", f"/v1/workers?{q}")["workers"][0]

    def plan(self, pid: int | None = None, npu: int | Sequence[int] | None = None,
             topology_policy: str | None = None, *, device_index: int | None = None,
             pool_source: str | None = None) -> dict:
        q: list[tuple[str, object]] = []
        if pid is not None:
            q.append(("pid", pid))
        for n in ([npu] if isinstance(npu, int) else list(npu or ())):
            q.append(("npu", n))
        if device_index is not None:
            q.append(("device_index", device_index))
        if topology_policy:
            q.append(("topology_policy", topology_policy))
        if pool_source:
            q.append(("pool_source", pool_source))
        return self._json("GET", "/v1/plan" + (f"?{urlencode(q)}" if q else ""))

    def health(self) -> dict:
        return self._json("GET", "/healthz")

    def metrics(self) -> str:
        _status, payload = self.request("GET", "/metrics")
        return payload if isinstance(payload, str) else json.dumps(payload)


def _api_error(status: int, payload) -> errors.AscendbindError:
    if isinstance(payload, dict):
        code, detail = str(payload.get("error", "error")), str(payload.get("detail", ""))
    else:
        code, detail = "error", str(payload)[:300]
    kind = _BY_STATUS.get(status, errors.AscendbindError)
    if kind is errors.PlanImpossible:
        exc: errors.AscendbindError = errors.PlanImpossible(detail or code, code=code)
    else:
        exc = kind(detail or code, code=code)
    exc.status = status  # type: ignore[attr-defined]
    exc.payload = payload  # type: ignore[attr-defined]
    return exc


# ---------------------------------------------------------------- ascendbind run

FORWARDED_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGWINCH, signal.SIGCONT, signal.SIGALRM)


def _tty_foreground() -> bool:
    """True when we are the terminal's foreground group: the tty signals our child itself."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def run_bound(argv: Sequence[str], npu: int | Sequence[int] | None, *, require_binding: bool = False,
              socket_path: str | None = None, topology_policy: str | None = None, stderr=None,
              pool_source: str | None = None) -> int:
    """Fork; the child binds itself, then execs ``argv``. Returns the command's exit status
    (128 + N when it died of signal N and re-raising that signal here did not end us)."""
    if not argv:
        raise errors.UsageError("run: no command given (ascendbind run [--npu N] -- CMD ...)")
    stderr = stderr or sys.stderr
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    try:
        child = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    if child == 0:  # pragma: no cover - runs in the forked child
        _child(argv, npu, require_binding, socket_path, (topology_policy, pool_source), stderr, old_mask)
    tty_fg = _tty_foreground()
    previous = {}
    for sig in FORWARDED_SIGNALS:
        if tty_fg and sig in (signal.SIGINT, signal.SIGQUIT):
            previous[sig] = signal.signal(sig, signal.SIG_IGN)  # the tty already told the child
        else:
            previous[sig] = signal.signal(sig, lambda s, _f: _forward(child, s))
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        _, status = os.waitpid(child, 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        stderr.flush()
        os.kill(os.getpid(), sig)  # die the way the command died, so our parent sees it
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


def _forward(child: int, sig: int) -> None:
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass


def _child(argv, npu, require_binding, socket_path, asks, stderr, old_mask) -> None:  # pragma: no cover
    code = 127
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        try:
            answer = Client(socket_path).bind(npu=npu, topology_policy=asks[0], pool_source=asks[1])
            # after the bind, before exec: everything the command allocates starts on its pool's node
            note = prefer_nodes(answer.get("plan") or {})
            if note.startswith("memory policy left alone"):
                print(f"ascendbind run: {note}", file=stderr)
                stderr.flush()
        except errors.AscendbindError as exc:
            if require_binding:
                print(f"ascendbind run: binding failed: {exc}", file=stderr)
                stderr.flush()
                os._exit(exc.exit_status)
            print(f"ascendbind run: warning: running unbound: {exc}", file=stderr)
            stderr.flush()
        try:
            os.execvp(argv[0], list(argv))
        except OSError as exc:
            code = 127 if exc.errno == errno.ENOENT else 126
            print(f"ascendbind run: cannot run {argv[0]}: {exc.strerror}", file=stderr)
            stderr.flush()
    finally:
        os._exit(code)
