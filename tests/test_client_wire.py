"""The client's own HTTP exchange against peers that answer well, badly or not at all.

Each test puts a scripted peer on a real Unix socket: it accepts one
connection and plays one answer (the daemon's own bytes where the daemon has
them), so what the client does with a 503 at accept, a closed connection, a
trickle, a chunked or oversized answer is seen on a real socket.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import pytest

from ascendbind import errors
from ascendbind.client import Client, exchange, render_request
from ascendbind.daemon.api.listener import _BUSY_BYTES
from ascendbind.daemon.api.wire import json_response, render_response


class Peer:
    """One scripted answer on ``path``: ``play(conn)`` runs on the accepted connection."""

    def __init__(self, path: str, play: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        self.play = play
        self.request = b""
        self.done = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
            with conn:
                self.play(conn)
        except BaseException as exc:  # noqa: BLE001 - reported by close()
            self.error = exc
        finally:
            self.done.set()

    def read_request(self, conn: socket.socket) -> bytes:
        """The request head and its Content-Length body, as the client sent them."""
        conn.settimeout(10)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            body += conn.recv(65536)
        self.request = buf[: len(head) + 4] + body
        return self.request

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stop.set()
        assert self.done.wait(10), "the scripted peer never finished"
        self.sock.close()
        if self.error is not None:
            raise self.error


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "api.sock")


def _answer(status: int, payload: dict) -> bytes:
    return render_response(json_response(status, payload), request_id="r1")


def test_a_bind_is_sent_as_one_http_request_and_its_json_answer_read(sock_path):
    answer = _answer(200, {"pid": 42, "outcome": "aligned", "plan": {"npus": [{"npu": 3}]}})

    def play(conn):
        peer.read_request(conn)
        for i in range(0, len(answer), 7):  # the answer in small pieces: the client reassembles it
            conn.sendall(answer[i:i + 7])

    with Peer(sock_path, play) as peer:
        got = Client(sock_path, timeout=10).bind(pid=42, npu=3)
    assert got == {"pid": 42, "outcome": "aligned", "plan": {"npus": [{"npu": 3}]}}
    head, _, body = peer.request.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/bind HTTP/1.1"
    assert b"Content-Type: application/json" in lines
    assert f"Content-Length: {len(body)}".encode() in lines
    assert json.loads(body) == {"pid": 42, "npu": 3}


def test_a_get_carries_no_body(sock_path):
    with Peer(sock_path, lambda conn: (peer.read_request(conn), conn.sendall(_answer(200, {"status": "ok"})))) as peer:
        assert Client(sock_path, timeout=10).health() == {"status": "ok"}
    assert peer.request.startswith(b"GET /healthz HTTP/1.1\r\n") and peer.request.endswith(b"\r\n\r\n")
    assert b"content-length" not in peer.request.lower()


def test_a_busy_daemon_answering_at_accept_is_a_503_the_caller_can_retry(sock_path):
    # the listener's own refusal: sent at accept, before the request is read, then closed
    with Peer(sock_path, lambda conn: conn.sendall(_BUSY_BYTES)):
        with pytest.raises(errors.DiscoveryError) as err:
            Client(sock_path, timeout=10).bind(pid=42, npu=0)
    assert err.value.status == 503 and err.value.code == "busy"
    assert err.value.exit_status == 5


def test_an_api_error_keeps_its_status_code_and_payload(sock_path):
    payload = {"error": "pid_gone", "detail": "no process 42"}
    with Peer(sock_path, lambda conn: (peer.read_request(conn), conn.sendall(_answer(404, payload)))) as peer:
        with pytest.raises(errors.ProcessGone) as err:
            Client(sock_path, timeout=10).release(pid=42)
    assert (err.value.status, err.value.code, err.value.payload) == (404, "pid_gone", payload)


def test_a_connection_closed_without_an_answer_is_unreachable(sock_path):
    with Peer(sock_path, lambda conn: peer.read_request(conn)) as peer:
        with pytest.raises(errors.DaemonUnreachable, match="closed before an answer"):
            Client(sock_path, timeout=10).health()


def test_an_answer_cut_short_is_refused(sock_path):
    answer = _answer(200, {"status": "ok", "pad": "x" * 100})

    with Peer(sock_path, lambda conn: (peer.read_request(conn), conn.sendall(answer[:-20]))) as peer:
        with pytest.raises(errors.DaemonUnreachable, match=r"closed after \d+ of \d+ body bytes"):
            Client(sock_path, timeout=10).health()


def test_a_trickling_answer_costs_one_timeout_not_one_per_byte(sock_path):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"

    def play(conn):
        peer.read_request(conn)
        conn.sendall(head)
        # one byte every 50 ms: each recv gets something, so only a deadline for
        # the whole exchange ends it
        while not peer.stop.wait(0.05):
            try:
                conn.sendall(b" ")
            except OSError:
                return

    with Peer(sock_path, play) as peer:
        t0 = time.monotonic()
        with pytest.raises(errors.DaemonUnreachable, match="did not answer within 0.5 s"):
            Client(sock_path, timeout=0.5).health()
        elapsed = time.monotonic() - t0
    assert elapsed < 5.0  # without the whole-exchange deadline: 1000 bytes x 50 ms = 50 s


def test_a_silent_daemon_costs_one_timeout(sock_path):
    with Peer(sock_path, lambda conn: (peer.read_request(conn), peer.stop.wait(30))) as peer:
        with pytest.raises(errors.DaemonUnreachable, match="did not answer within 0.3 s"):
            Client(sock_path, timeout=0.3).health()


@pytest.mark.parametrize("head,why", [
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
     "Transfer-Encoding"),
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n", "no Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n", "conflicting Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\n", "not a byte count"),
    (b"HTTP/1.1 100 Continue\r\n\r\n", "interim 100"),
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header field"),
])
def test_an_answer_the_daemon_never_sends_is_refused(sock_path, head, why):
    with Peer(sock_path, lambda conn: (peer.read_request(conn), conn.sendall(head + b'2\r\n{}\r\n0\r\n\r\n'))) as peer:
        with pytest.raises(errors.DaemonUnreachable, match=why):
            Client(sock_path, timeout=10).health()


def test_an_oversized_answer_is_refused_before_its_body_is_read(sock_path):
    def play(conn):
        peer.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5000000\r\n\r\n")
        peer.stop.wait(30)  # the body never comes: only a refusal at the head ends this quickly

    with Peer(sock_path, play) as peer:
        with pytest.raises(errors.DaemonUnreachable, match="an answer of 5000000 bytes"):
            Client(sock_path, timeout=20, max_answer=1 << 20).health()


def test_an_endless_head_is_refused(sock_path):
    def play(conn):
        peer.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
        try:
            while not peer.stop.is_set():
                conn.sendall(line)
        except OSError:
            return

    with Peer(sock_path, play) as peer:
        with pytest.raises(errors.DaemonUnreachable, match="head larger than"):
            Client(sock_path, timeout=20).health()


def test_no_socket_is_unreachable(sock_path):
    with pytest.raises(errors.DaemonUnreachable, match="no ascendbind daemon") as err:
        Client(sock_path, timeout=5).health()
    assert err.value.exit_status == 4


def test_a_socket_nobody_listens_on_is_unreachable(sock_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock_path)  # bound, never listening: connect() is refused
    try:
        with pytest.raises(errors.DaemonUnreachable, match="no ascendbind daemon"):
            Client(sock_path, timeout=5).health()
    finally:
        s.close()


def test_exchange_returns_the_status_the_content_type_and_the_exact_body(sock_path):
    body = b'{"a": 1}\n'
    answer = b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 9\r\n\r\n" + body
    with Peer(sock_path, lambda conn: (peer.read_request(conn), conn.sendall(answer))) as peer:
        got = exchange(sock_path, render_request("GET", "/x", None), 10)
    assert got == (201, "text/plain", body)
