"""One listening socket served by an epoll loop and a bounded pool of workers.

Both the API's Unix socket and the metrics TCP port run on this, each with its
own ``Limits``, so a client can cost the daemon at most one file descriptor,
one bounded buffer and a few seconds, and nothing done to one listener reaches
the other:

* a connection is admitted at accept() or answered 503 ``busy`` and closed at
  once: at most ``max_total`` open; at most ``per_peer`` for one peer (the uid
  from SO_PEERCRED on a Unix socket, the address on TCP); uid 0 alone may use
  the last ``root_reserve`` places, so no number of other users' connections
  keeps root out;
* the loop reads every admitted connection without blocking: the request line
  must arrive within ``line_timeout`` and the whole request within
  ``request_timeout`` (a client trickling bytes does not extend it), else 408;
  idle and slow clients therefore hold no thread at all;
* only a complete request reaches a worker thread: ``workers`` threads for
  everyone, shared fairly (fairshare.py: one peer runs at most
  ``peer_workers`` requests at once and waits its turn behind the others), plus
  ``root_workers`` that serve uid 0 only, shared the same way between the
  callers ``share_key`` tells apart (root in each PID namespace, on the API), so
  neither a flood of one user's requests nor a few slow ones delay another
  user's or root's;
* a request ``inline`` picks (a liveness probe: cheap, lock-free) is answered
  on the loop itself, so it never waits for a thread, whoever holds them;
* an answer the loop makes itself (400, 408, 413, 503) is sent without
  blocking; the socket is then drained for at most ``LINGER`` seconds, so the
  client reads the answer instead of a reset while it is still sending;
* the listening backlog is the host's ``somaxconn``: a burst waits in the queue
  for its 503 instead of failing connect() with EAGAIN;
* out of descriptors (EMFILE), the loop stops watching the listening socket for
  ``ACCEPT_PAUSE``: epoll is level-triggered and the connection stays queued, so
  retrying at once would spin a CPU; a bug while taking or reading one
  connection costs that connection, never the loop.

The loop sleeps in epoll with no timeout while no connection is open.
"""

from __future__ import annotations

import collections
import errno
import os
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ...discovery.read.kernel import somaxconn
from .fairshare import FairPool
from .wire import CONTINUE, Request, RequestReader, Response, WireError, error_response, render_response
from ..runtime.threadname import name_os_thread

__all__ = ["Limits", "Listener", "Conn"]

log = structlog.get_logger("ascendbind.listener")

LINGER = 1.0
ACCEPT_PAUSE = 0.1
LINGER_BYTES = 1 << 20
_ACCEPT_BURST = 64
_BUSY = WireError(503, "busy", "too many connections open; retry", {"Retry-After": "1"})
_BUSY_BYTES = render_response(error_response(_BUSY))


@dataclass(frozen=True)
class Limits:
    max_total: int
    per_peer: int
    root_reserve: int = 0
    workers: int = 4
    # how many of the shared ``workers`` one peer may hold at once (0: all of them)
    peer_workers: int = 0
    root_workers: int = 0
    # how many of the ``root_workers`` one root caller (its share key) may hold at once (0: all)
    root_peer_workers: int = 0
    line_timeout: float = 2.0
    request_timeout: float = 5.0
    write_timeout: float = 5.0
    max_body: int = 64 * 1024


class Conn:
    """One admitted connection as the loop and the worker see it."""

    __slots__ = ("sock", "peer", "key", "is_root", "id", "reader", "opened", "line_deadline", "deadline",
                 "lingering", "drained", "continued", "released", "identified_in", "after_send")

    def __init__(self, sock: socket.socket, peer, key, is_root: bool, limits: Limits, now: float) -> None:
        self.sock, self.peer, self.key, self.is_root = sock, peer, key, is_root
        self.id = uuid.uuid4().hex[:16]
        self.reader = RequestReader(limits.max_body)
        self.opened = now
        self.line_deadline = now + limits.line_timeout
        self.deadline = now + limits.request_timeout
        self.lingering = False
        self.drained = 0
        self.continued = False
        self.released = False
        self.identified_in = 0.0  # seconds identify() took at accept (SO_PEERCRED)
        # set by the handler: called once its answer is sent, or could not be (a bind's clock
        # stops there, and what waits for the answer starts)
        self.after_send: Callable[[], None] | None = None


# handle(conn, request) -> Response, run on a worker; refused(conn or None, error) counts/logs
# the answers the loop made itself; identify(sock) -> (peer, key, is_root) at accept.
Handler = Callable[[Conn, Request], Response]
Refused = Callable[["Conn | None", WireError], None]
Identify = Callable[[socket.socket], tuple[object, object, bool]]
# inline(request) -> True: answer it on the loop; share_key(conn) -> whose share of the threads it uses
Inline = Callable[[Request], bool]
ShareKey = Callable[[Conn], object]


class Listener:
    def __init__(self, sock: socket.socket, limits: Limits, handle: Handler, *, identify: Identify,
                 refused: Refused | None = None, name: str = "listener", inline: Inline | None = None,
                 share_key: ShareKey | None = None) -> None:
        self.sock, self.limits, self.handle, self.identify = sock, limits, handle, identify
        self.refused = refused or (lambda conn, err: None)
        self.inline = inline or (lambda request: False)
        self.share_key = share_key or (lambda conn: conn.key)
        self.name = name
        sock.listen(somaxconn())  # a second listen() on a listening socket only resizes its backlog
        sock.setblocking(False)
        self._lock = threading.Lock()
        self._open = 0
        self._per_key: collections.Counter = collections.Counter()
        self._conns: dict[int, Conn] = {}  # fd -> connection the loop is reading
        self._pool = FairPool(limits.workers, limits.peer_workers or limits.workers, name=f"{name}-worker")
        self._root_pool = (FairPool(limits.root_workers, limits.root_peer_workers or limits.root_workers,
                                    name=f"{name}-root")
                           if limits.root_workers else None)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = False
        self._accept_paused_until: float | None = None
        self._sel = selectors.EpollSelector()
        self._sel.register(sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    # ------------------------------------------------------------ accounting

    def open_connections(self) -> int:
        with self._lock:
            return self._open

    def _admit(self, key, is_root: bool) -> bool:
        lim = self.limits
        with self._lock:
            if self._open >= lim.max_total:
                return False
            if not is_root and (self._open >= lim.max_total - lim.root_reserve or self._per_key[key] >= lim.per_peer):
                return False
            self._open += 1
            self._per_key[key] += 1
            return True

    def _release(self, conn: Conn) -> None:
        with self._lock:
            if conn.released:
                return
            conn.released = True
        try:
            conn.sock.close()
        except OSError:
            pass
        with self._lock:
            self._open -= 1
            self._per_key[conn.key] -= 1
            if self._per_key[conn.key] <= 0:
                del self._per_key[conn.key]

    # ------------------------------------------------------------ the loop

    def serve(self) -> None:
        name_os_thread()
        try:
            while not self._stopping:
                for key, _ in self._sel.select(self._timeout()):
                    self._event(key.data)
                now = time.monotonic()
                self._expire(now)
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._accept_paused_until = None
                    self._sel.register(self.sock, selectors.EVENT_READ, "accept")
        finally:
            self._close_all()

    def _event(self, what) -> None:
        try:
            if what == "accept":
                self._accept_some()
            elif what == "wake":
                _drain_pipe(self._wake_r)
            else:
                self._readable(what)
        except Exception as exc:  # noqa: BLE001 - one connection's bug must not end the loop for everyone
            log.error("listener event failed", listener=self.name, exception=type(exc).__name__,
                      detail=str(exc)[:200])
            if isinstance(what, Conn):
                self._forget(what)
                self._release(what)

    def _timeout(self) -> float | None:
        deadlines = [c.deadline if c.reader.line_done or c.lingering else min(c.line_deadline, c.deadline)
                     for c in self._conns.values()]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic()) + 0.001

    def _accept_some(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                s, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE/ENFILE/ENOBUFS: the connection stays queued, and the listening socket stays
                # readable, so stop watching it for a moment instead of spinning on it
                log.warning("accept failed", listener=self.name, error=errno.errorcode.get(exc.errno, str(exc)))
                self._sel.unregister(self.sock)
                self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE
                return
            try:
                self._take(s)
            except Exception as exc:  # noqa: BLE001 - a bug costs this connection, never the loop
                log.error("connection dropped at accept", listener=self.name, exception=type(exc).__name__,
                          detail=str(exc)[:200])
                s.close()

    def _take(self, s: socket.socket) -> None:
        t0 = time.perf_counter()
        try:
            peer, key, is_root = self.identify(s)
        except OSError:
            peer, key, is_root = None, None, False
        identified_in = time.perf_counter() - t0
        if not self._admit(key, is_root):
            _send_now(s, _BUSY_BYTES)
            s.close()
            self.refused(None, _BUSY)
            return
        s.setblocking(False)
        conn = Conn(s, peer, key, is_root, self.limits, time.monotonic())
        conn.identified_in = identified_in
        self._conns[s.fileno()] = conn
        self._sel.register(s, selectors.EVENT_READ, conn)
        # a client writes its request right after connect(): it is usually here already,
        # and reading it now saves a trip through epoll (a recv that finds nothing is
        # EAGAIN, and the loop waits for the data as before)
        self._event(conn)

    def _readable(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if conn.lingering:
            conn.drained += len(data)
            if not data or conn.drained > LINGER_BYTES:
                self._forget(conn)
                self._release(conn)
            return
        try:
            if not data:
                raise conn.reader.feed_eof()
            request = conn.reader.feed(data)
        except WireError as err:
            self._answer_here(conn, err)
            return
        if request is None:
            if conn.reader.wants_continue and not conn.continued:
                conn.continued = True
                _send_now(conn.sock, CONTINUE)
            return
        self._forget(conn)
        if self.inline(request):
            # sent without blocking (a small answer fits an empty socket buffer; a client that does
            # not read it loses it) and closed at once, as a worker thread closes after its answer:
            # the request is complete, so nothing of the client's is left unread
            resp = self.handle(conn, request)
            _send_now(conn.sock, render_response(resp, request_id=conn.id, head_only=request.method == "HEAD"))
            self._release(conn)
            return
        pool = self._root_pool if conn.is_root and self._root_pool is not None else self._pool
        try:
            pool.submit(self.share_key(conn), self._work, conn, request)
        except RuntimeError:  # shutting down
            self._release(conn)

    def _expire(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if conn.lingering:
                if now >= conn.deadline:
                    self._forget(conn)
                    self._release(conn)
            elif now >= conn.deadline or (not conn.reader.line_done and now >= conn.line_deadline):
                what = "request line" if not conn.reader.line_done else "request"
                self._answer_here(conn, WireError(408, "request_timeout", f"the {what} was not received in time"))

    def _answer_here(self, conn: Conn, err: WireError) -> None:
        """Answer from the loop without blocking, then linger-drain so the client sees it."""
        _send_now(conn.sock, render_response(error_response(err), request_id=conn.id))
        self.refused(conn, err)
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.lingering = True
        conn.deadline = time.monotonic() + LINGER

    def _forget(self, conn: Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    # ------------------------------------------------------------ workers

    def _work(self, conn: Conn, request: Request) -> None:
        try:
            resp = self.handle(conn, request)
            data = render_response(resp, request_id=conn.id, head_only=request.method == "HEAD")
            conn.sock.settimeout(self.limits.write_timeout)
            conn.sock.sendall(data)
        except OSError:
            pass  # the client went away or stopped reading: nothing left to tell it
        finally:
            try:
                if conn.after_send is not None:  # whether or not the client took the answer
                    conn.after_send()
            finally:
                self._release(conn)

    # ------------------------------------------------------------ stop

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        for pool in (self._pool, self._root_pool):
            if pool is not None:
                for _work, (conn, _request) in pool.stop():
                    self._release(conn)

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            self._forget(conn)
            self._release(conn)
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _send_now(sock: socket.socket, data: bytes) -> None:
    """Best effort, never blocking: a small answer fits in an empty socket buffer."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except OSError:
        pass
