"""HTTP on the daemon's socket and metrics port, against a real ``ascendbind serve``.

Malformed, truncated and slow requests get a status line and a JSON error and
change nothing; another uid holding hundreds of idle or trickling connections,
or a thousand idle connections on the metrics port, cannot keep root's bind
from completing within a second or run the daemon out of descriptors; a seeded
fuzzer finds no 5xx besides 503/505 and no traceback.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from ascendbind.client import Client
from ascendbind.daemon.api.requests import MAX_JSON_DEPTH
from ascendbind.daemon.api.server import API_LIMITS
from tests import soak
from tests.daemon_harness import ROOT, metric_value, public_daemon, wait_for
from tests.http_fuzz import exchange
from tests.workers import start_worker

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv not installed")


@pytest.fixture(scope="module")
def daemon():
    with public_daemon("ascendbind-http-") as d:
        os.chmod(d.sock, 0o666)  # the hostile-uid tests connect as 65534
        yield d


pytestmark = pytest.mark.usefixtures("daemon_survives")  # each test leaves the shared daemon as it found it


def parse(raw: bytes) -> tuple[int, dict[str, str], object]:
    """(status, headers, JSON body) of one reply; fails the test on a reply without a status line."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert sep and lines[0].startswith("HTTP/1.1 "), raw[:200]
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body), raw[:300]
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def read_all(s: socket.socket) -> bytes:
    """The reply to EOF (a reset after it, from a server closing on unread input, ends it too)."""
    raw = b""
    try:
        while chunk := s.recv(4096):
            raw += chunk
    except ConnectionResetError:
        pass
    return raw


def ask(daemon, data: bytes) -> tuple[int, dict[str, str], object]:
    return parse(exchange(daemon.sock, data))


def api_metric(daemon, name: str, **labels: str) -> float | None:
    """A metric read over the API socket (the TCP port may be the thing under attack)."""
    _, text = daemon.curl("GET", "/metrics", timeout=10)
    return metric_value(text, name, **labels)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def timed_bind(client: Client, pid: int) -> float:
    t0 = time.monotonic()
    client.bind(pid=pid, npu=0)
    took = time.monotonic() - t0
    client.release(pid=pid)
    return took


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---------------------------------------------------------------- exact cases


def test_request_line_cut_by_the_deadline_is_408_json(daemon):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(15)
        s.connect(daemon.sock)
        s.sendall(b"GET /heal")
        raw = read_all(s)
    status, _, body = parse(raw)
    assert status == 408 and body["error"] == "request_timeout", body
    assert "Traceback" not in daemon.log() and "AttributeError" not in daemon.log()


def test_http_2_is_505_with_a_status_line(daemon):
    status, _, body = ask(daemon, b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n")
    assert status == 505 and body["error"] == "http_version_not_supported"
    # HTTP/0.9's request line (no version) gets a status line too, never a bare body
    status, _, body = ask(daemon, b"GET /healthz\r\n\r\n")
    assert status == 400 and body["error"] == "bad_http"
    assert ask(daemon, b"GET /healthz HTTP/1.0\r\n\r\n")[0] == 200


_CALLER = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode().decode("unicode_escape").encode("latin-1"))
s.shutdown(socket.SHUT_WR)
out = b""
while chunk := s.recv(4096):
    out += chunk
sys.stdout.write(out.decode("latin-1"))
"""


@pytest.mark.parametrize("request_bytes", [
    # the head ends by EOF, not by an empty line: a bind of the caller itself if it were executed
    r"POST /v1/bind HTTP/1.1\r\nHost: x\r\nContent-Type: application/json",
    r"POST /v1/bind HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n",
    # the body ends by EOF before Content-Length bytes
    r"POST /v1/bind HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{\"npu\": 0}",
])
def test_request_cut_by_eof_is_400_and_nothing_is_done(daemon, request_bytes):
    before = sum(api_metric(daemon, "ascendbind_bind_requests_total", outcome=o) or 0
                 for o in ("aligned", "unaligned", "failed", "rejected"))
    # the caller is a throw-away process: were the request executed, it would bind that process
    r = subprocess.run([sys.executable, "-c", _CALLER, daemon.sock, request_bytes], capture_output=True,
                       timeout=30)
    status, _, body = parse(r.stdout)
    assert status == 400 and body["error"] == "incomplete_request", body
    assert Client(daemon.sock).workers()["workers"] == []
    after = sum(api_metric(daemon, "ascendbind_bind_requests_total", outcome=o) or 0
                for o in ("aligned", "unaligned", "failed", "rejected"))
    assert after == before


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("OPTIONS", "/v1/bind", "POST"),
    ("TRACE", "/healthz", "GET, HEAD"),
    ("get", "/healthz", "GET, HEAD"),
    ("post", "/v1/bind", "POST"),
    ("DELETE", "/v1/workers", "GET, HEAD"),
])
def test_other_methods_are_405_with_allow(daemon, method, path, allow):
    status, headers, body = ask(daemon, f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status == 405 and body["error"] == "method_not_allowed" and headers["allow"] == allow


@pytest.mark.parametrize(("raw", "error"), [
    (b"[" * 5000 + b"]" * 5000, "bad_json"),
    (b'{"npu": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "bad_json"),
    (b'{"npu": [0, 1, null]}', "bad_request"),
    (b'{"npu": [null]}', "bad_request"),
    (b'{"npu": []}', "bad_request"),
    (b'{"pid": 1e400, "npu": 0}', "bad_request"),
    (b'{"pid": 99999999999999999999999, "npu": 0}', "bad_request"),
    (b'{"npu": 0, "topology_policy": ["none"]}', "bad_request"),
    (b'{"npu": 0, "topology_policy": {"a": 1}}', "bad_request"),
    (b'{"pid": ' + b"9" * 5000 + b"}", "bad_json"),
])
def test_hostile_json_is_400(daemon, raw, error):
    head = f"POST /v1/bind HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
    status, _, body = ask(daemon, head + raw)
    assert (status, body["error"]) == (400, error), body


def test_bad_heads_are_400_or_411_with_json(daemon):
    cases = {
        b"POST /v1/bind HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n{}": 400,
        b"POST /v1/bind HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n": 411,
        b"POST /v1/bind HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}": 400,
        b"GET /healthz HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n": 400,
        b"GET /healthz HTTP/1.1\r\nBad Name: 1\r\n\r\n": 400,
        b"GET /he\xffalthz HTTP/1.1\r\n\r\n": 400,
        b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n": 400,
        b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\n\r\n": 400,
    }
    for data, want in cases.items():
        status, _, body = ask(daemon, data)
        assert status == want and set(body) == {"error", "detail"}, (data[:60], body)


# ---------------------------------------------------------------- abuse: connections


def test_body_trickled_past_the_deadline_is_408(daemon):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(b'POST /v1/bind HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"npu"')
        status, _, body = parse(read_all(s))
    assert status == 408 and body["error"] == "request_timeout", body


_EXCESS = r"""
import socket, sys
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    socks.append(s)
socks[-1].settimeout(30)
print(socks[-1].recv(4096).split(b"\r\n", 1)[0].decode())
"""


@needs_setpriv
def test_one_uid_past_its_share_is_503_at_once_and_root_still_gets_in(daemon):
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    p = subprocess.Popen([*NOBODY, py, "-c", _EXCESS, daemon.sock, str(API_LIMITS.per_peer + 1)],
                         stdout=subprocess.PIPE, text=True)
    try:
        first_line = p.stdout.readline()
        # root is served whatever other uids hold (the last places are kept for uid 0)
        assert Client(daemon.sock, timeout=30).health()["status"] == "ok"
    finally:
        p.kill()
        p.wait()
    assert first_line.split()[1] == "503", first_line


def _abuser(daemon, idle: int, trickle: int) -> subprocess.Popen:
    # /usr/bin/python3: stdlib only, reachable by uid 65534. The script runs from a
    # world-readable copy: the checkout may sit in a directory that uid cannot enter.
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    scratch = Path(tempfile.mkdtemp(prefix="ascendbind-abuse-"))
    scratch.chmod(0o755)
    script = scratch / "http_abuse.py"
    shutil.copyfile(ROOT / "tests" / "http_abuse.py", script)
    script.chmod(0o644)
    p = subprocess.Popen([*NOBODY, py, str(script), daemon.sock, "--idle", str(idle),
                          "--trickle", str(trickle)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         cwd=scratch)
    p.scratch = scratch
    assert p.stdout.readline().strip() == "ready"
    return p


def _stop_abuser(p: subprocess.Popen) -> dict:
    try:
        out, _ = p.communicate(input="", timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(p.scratch, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


@needs_setpriv
@pytest.mark.soak
def test_root_binds_within_a_second_while_another_uid_hogs_the_socket(daemon):
    refused_before = api_metric(daemon, "ascendbind_connections_refused_total", listener="api")
    timeouts_before = api_metric(daemon, "ascendbind_http_requests_total", path="other", code="408") or 0
    fds_before = open_fds(daemon.pid)
    client = Client(daemon.sock, timeout=30)
    abuser = _abuser(daemon, idle=200, trickle=8)
    try:
        # the caps bite: the abuser's connections past its share are being turned away
        assert wait_for(lambda: api_metric(daemon, "ascendbind_connections_refused_total", listener="api")
                        > refused_before + 200, 20)
        # and the ones it holds are being cut by the deadlines
        assert wait_for(lambda: api_metric(daemon, "ascendbind_http_requests_total", path="other", code="408")
                        > timeouts_before, 20)
        with start_worker(plain=1, acl=0, release=0) as w:
            took = [timed_bind(client, w.pid) for _ in range(soak.count(5, 30))]
        fds_during = open_fds(daemon.pid)
    finally:
        stats = _stop_abuser(abuser)
    assert max(took) < 1.0, took
    # one uid holds at most its share; the daemon's descriptors stay within its budget
    assert fds_during <= fds_before + API_LIMITS.per_peer + 8, (fds_before, fds_during)
    # a burst never finds the backlog full: every connect succeeds and every answer has a status line
    assert stats["eagain"] == 0 and stats["no_status_line"] == 0, stats
    assert stats["replies"].get("503", 0) > 0 and stats["replies"].get("408", 0) > 0, stats


def test_a_queued_burst_past_the_old_backlog_gets_answers_not_eagain(daemon, many_fds):
    # far past a backlog of 64 and past the connection cap, within what this machine lets a listen
    # backlog be: the kernel caps listen()'s at net.core.somaxconn (4096 by default since Linux 5.4,
    # an operator's choice on some machines)
    with open("/proc/sys/net/core/somaxconn") as fh:
        somaxconn = int(fh.read())
    n = min(600, somaxconn)
    if n <= max(64, API_LIMITS.max_total):
        pytest.skip(f"net.core.somaxconn = {somaxconn}: no backlog past the connection cap to queue a burst in")
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    socks = []
    os.kill(daemon.pid, signal.SIGSTOP)  # nothing is accepted: every connection waits in the backlog
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            socks.append(s)
            s.connect(daemon.sock)  # BlockingIOError here would be the EAGAIN of a full backlog
            s.setblocking(True)
            s.settimeout(30)
            s.sendall(request)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    statuses = []
    try:
        for s in socks:
            statuses.append(parse(read_all(s))[0])
    finally:
        for s in socks:
            s.close()
    assert set(statuses) <= {200, 503} and statuses.count(200) >= API_LIMITS.max_total, statuses


@pytest.mark.soak
def test_metrics_port_flood_leaves_the_api_answering(daemon, many_fds):
    client = Client(daemon.sock, timeout=30)
    fds_before = open_fds(daemon.pid)
    conns = []
    try:
        for _ in range(1100):
            conns.append(socket.create_connection(("127.0.0.1", daemon.port), timeout=10))
        fds_during = open_fds(daemon.pid)
        t0 = time.monotonic()
        assert client.health()["status"] == "ok"
        health_took = time.monotonic() - t0
        assert wait_for(lambda: api_metric(daemon, "ascendbind_connections_refused_total", listener="metrics")
                        >= 1100 - 16, 20)
        fds_during = max(fds_during, open_fds(daemon.pid))
        with start_worker(plain=1, acl=0, release=0) as w:
            bind_took = max(timed_bind(client, w.pid) for _ in range(soak.count(1, 30)))
    finally:
        for s in conns:
            s.close()
    assert health_took < 1.0 and bind_took < 1.0, (health_took, bind_took)
    assert fds_during <= fds_before + 16 + 8, (fds_before, fds_during)
    # and the port itself recovers once the flood is gone
    assert wait_for(lambda: "ascendbind_build_info" in daemon.metrics_text(), 15)


# ---------------------------------------------------------------- fuzz


@pytest.mark.soak
def test_seeded_fuzz_gets_a_status_line_and_json_every_time(daemon):
    with start_worker(plain=1, acl=0, release=0) as w:
        # its own process: a body without "pid" binds the caller, which must not be pytest
        r = subprocess.run([sys.executable, "-m", "tests.http_fuzz", "--socket", daemon.sock, "--requests", str(soak.count(2000, 10_000)),
                            "--seed", "20261130", "--pid", str(w.pid)], capture_output=True, text=True,
                           cwd=str(ROOT), timeout=600)
    assert r.returncode == 0, r.stderr
    figures = json.loads(r.stdout)
    assert figures["no_status_line"] == 0 and figures["unexpected_5xx"] == 0, figures
    assert figures["problems"] == {}, figures
    # the fuzz reached the handlers, not only the HTTP reader
    assert {"200", "400", "404", "405", "505"} <= set(figures["statuses"]), figures
    assert {"bad_json", "bad_request", "incomplete_request"} <= set(figures["errors"]), figures
    log = daemon.log()
    assert "Traceback" not in log and "request failed unexpectedly" not in log
    assert api_metric(daemon, "ascendbind_http_internal_errors_total") == 0


# ---------------------------------------------------------------- the listener alone


def test_a_bug_at_accept_costs_one_connection_not_the_loop(tmp_path):
    from ascendbind.daemon.api.listener import Limits, Listener
    from ascendbind.daemon.api.wire import json_response

    calls = []

    def identify(sock):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in identify")
        return None, "peer", False

    path = str(tmp_path / "l.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    listener = Listener(lsock, Limits(max_total=4, per_peer=4, workers=1), lambda c, r: json_response(200, {}),
                        identify=identify)
    loop = threading.Thread(target=listener.serve, daemon=True)
    loop.start()
    try:
        first = exchange(path, b"GET / HTTP/1.1\r\n\r\n", timeout=10)
        assert first == b""  # that connection was dropped
        assert parse(exchange(path, b"GET / HTTP/1.1\r\n\r\n", timeout=10))[0] == 200
        assert wait_for(lambda: listener.open_connections() == 0, 10)
    finally:
        listener.stop()
        loop.join(10)
        lsock.close()
    assert not loop.is_alive()


def _lowest_free_fd() -> int:
    fd = os.open("/dev/null", os.O_RDONLY)  # the kernel hands out the lowest free number
    os.close(fd)
    return fd


def test_out_of_descriptors_pauses_accepting_instead_of_spinning_and_recovers(tmp_path):
    from structlog.testing import capture_logs

    from ascendbind.daemon.api.listener import ACCEPT_PAUSE, Limits, Listener
    from ascendbind.daemon.api.wire import json_response

    path = str(tmp_path / "l.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    listener = Listener(lsock, Limits(max_total=4, per_peer=4, workers=1), lambda c, r: json_response(200, {}),
                        identify=lambda s: (None, "peer", False))
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    loop = threading.Thread(target=listener.serve, daemon=True)
    try:
        with capture_logs() as logs:
            loop.start()
            failures = lambda: [e for e in logs if e["event"] == "accept failed"]  # noqa: E731
            client.settimeout(30)
            # no descriptor left for this process: accept() fails with EMFILE while the connection waits
            resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd(), hard))
            client.connect(path)
            assert wait_for(lambda: len(failures()) >= 1, 10, interval=0.005)
            t0 = time.monotonic()
            assert wait_for(lambda: len(failures()) >= 3, 10, interval=0.005)
            # each failure is followed by a pause, not by the next accept() at once
            assert time.monotonic() - t0 >= 1.5 * ACCEPT_PAUSE
            assert failures()[0]["error"] == "EMFILE"
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            client.sendall(b"GET / HTTP/1.1\r\n\r\n")
            client.shutdown(socket.SHUT_WR)
            assert parse(read_all(client))[0] == 200
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.close()
        listener.stop()
        loop.join(10)
        lsock.close()
