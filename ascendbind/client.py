"""Client of the ascendbind daemon: stdlib only, so a worker can import it.

    from ascendbind.client import Client
    Client().bind(npu=3)            # bind this very process (pid taken from SO_PEERCRED)
    Client().bind(pid=1234, npu=3)  # bind another process (root, or your own descendant)
    Client().release(pid=1234); Client().workers(); Client().plan(npu=3); Client().health()
    Client().worker(1234, explain=True)  # one bound worker, with its plan explanation

API errors are raised as ascendbind.errors exceptions (also stdlib only), whose
``exit_status`` is the CLI's exit status (docs/cli.md): 400 -> 2, 403 -> 7, 404 -> 6, 409 -> 9,
413 -> 2, 422 -> 3, 503 -> 5, socket absent / nobody answering -> 4. The
exception carries ``status`` (HTTP) and ``payload`` (the JSON body).

``run_bound`` is ``ascendbind run``: fork; the child asks the daemon to bind
*itself* (so it works from inside a container's pid namespace), then execs the
command; the parent forwards signals and returns the command's status.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import signal
import socket
import sys
from collections.abc import Sequence
from urllib.parse import urlencode

from . import errors
from .config import DEFAULT_SOCKET
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


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.unix_path)
        except BaseException:
            s.close()
            raise
        self.sock = s


class Client:
    def __init__(self, socket_path: str | None = None, *, timeout: float = 120.0) -> None:
        self.socket_path = socket_path or default_socket()
        self.timeout = timeout

    # ------------------------------------------------------------ transport

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
        conn = _UnixConnection(self.socket_path, self.timeout)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            status, ctype = resp.status, resp.getheader("Content-Type", "")
        except PermissionError:
            raise errors.NotPermitted(
                f"permission denied on {self.socket_path}: ask for the daemon's socket group"
            ) from None
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise errors.DaemonUnreachable(
                f"no ascendbind daemon on {self.socket_path} ({exc.strerror}); is `ascendbind serve` running?"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise errors.DaemonUnreachable(f"ascendbind daemon on {self.socket_path} did not answer: {exc}") from None
        finally:
            conn.close()
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
             topology_policy: str | None = None) -> dict:
        body: dict = {}
        if pid is not None:
            body["pid"] = pid
        if npu is not None:
            body["npu"] = npu if isinstance(npu, int) else list(npu)
        if topology_policy is not None:
            body["topology_policy"] = topology_policy
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
             topology_policy: str | None = None) -> dict:
        q: list[tuple[str, object]] = []
        if pid is not None:
            q.append(("pid", pid))
        for n in ([npu] if isinstance(npu, int) else list(npu or ())):
            q.append(("npu", n))
        if topology_policy:
            q.append(("topology_policy", topology_policy))
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
              socket_path: str | None = None, topology_policy: str | None = None, stderr=None) -> int:
    """Fork; the child binds itself, then execs ``argv``. Returns the command's exit status
    (128 + N when it died of signal N and re-raising that signal here did not end us)."""
    if not argv:
        raise errors.UsageError("run: no command given (ascendbind run --npu N -- CMD ...)")
    stderr = stderr or sys.stderr
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    try:
        child = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    if child == 0:  # pragma: no cover - runs in the forked child
        _child(argv, npu, require_binding, socket_path, topology_policy, stderr, old_mask)
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


def _child(argv, npu, require_binding, socket_path, topology_policy, stderr, old_mask) -> None:  # pragma: no cover
    code = 127
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        try:
            Client(socket_path).bind(npu=npu, topology_policy=topology_policy)
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
