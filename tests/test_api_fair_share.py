"""One user's slow requests never delay another user's or root's.

The pool (daemon/api/fairshare.py) is driven with plain calls that block on
events; the daemon test makes uid 65534 keep eight binds waiting on a hung
npu-smi process table (every one of them needs it) and checks that uid 65533's
and root's ``/healthz`` still answer at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest

from ascendbind.client import Client
from ascendbind.daemon.api.fairshare import FairPool
from ascendbind.daemon.api.server import API_LIMITS
from tests.daemon_harness import public_daemon, wait_for
from tests.hanging_tool import HangingNpuSmi

WAIT = 10.0


def _blocker(pool_log: list, gate: threading.Event, started: threading.Semaphore, tag: str):
    def call():
        pool_log.append(tag)
        started.release()
        gate.wait(WAIT)
    return call


def test_one_peer_holds_at_most_its_share_and_another_peer_runs_at_once():
    pool = FairPool(4, 2, name="t-share")
    gate, started, ran = threading.Event(), threading.Semaphore(0), []
    try:
        for i in range(6):
            pool.submit("hog", _blocker(ran, gate, started, f"hog{i}"))
        assert started.acquire(timeout=WAIT) and started.acquire(timeout=WAIT)
        other = threading.Event()
        pool.submit("other", other.set)
        # two threads are free, but the hog may hold only two: the other peer runs now
        assert other.wait(WAIT)
        assert pool.running("hog") == 2 and pool.queued() == 4
        assert not started.acquire(timeout=0.2), ran  # no third hog call ever started
    finally:
        gate.set()
        pool.stop()


def test_a_free_thread_takes_the_peer_that_waited_longest_for_a_turn():
    pool = FairPool(1, 1, name="t-turns")
    gate, started, order = threading.Event(), threading.Semaphore(0), []
    done = threading.Semaphore(0)

    def note(tag):
        def call():
            order.append(tag)
            done.release()
        return call

    try:
        pool.submit("a", _blocker(order, gate, started, "a1"))
        assert started.acquire(timeout=WAIT)
        pool.submit("a", note("a2"))
        pool.submit("a", note("a3"))
        pool.submit("b", note("b1"))
        gate.set()
        for _ in range(3):
            assert done.acquire(timeout=WAIT)
        # b queued its one request after a's three, and still runs second
        assert order == ["a1", "b1", "a2", "a3"]
    finally:
        pool.stop()


def test_stop_hands_back_what_was_queued_refuses_more_and_waits_for_nothing():
    pool = FairPool(1, 1, name="t-stop")
    gate, started, ran = threading.Event(), threading.Semaphore(0), []
    try:
        pool.submit("a", _blocker(ran, gate, started, "stuck"))
        assert started.acquire(timeout=WAIT)
        pool.submit("b", ran.append, "never")
        t0 = time.monotonic()
        left = pool.stop()
        assert time.monotonic() - t0 < 1.0  # the stuck call is not waited for
        assert [args for _fn, args in left] == [("never",)]
        with pytest.raises(RuntimeError):
            pool.submit("c", ran.append, "late")
        # nothing joins the pool's threads at exit: a stuck one cannot hold the process
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-stop"))
    finally:
        gate.set()
    assert ran == ["stuck"]


def test_a_peer_that_raises_gets_its_share_back():
    pool = FairPool(1, 1, name="t-raise")
    done = threading.Event()
    try:
        pool.submit("a", lambda: 1 / 0)
        pool.submit("a", done.set)
        assert done.wait(WAIT)
        assert wait_for(lambda: pool.running("a") == 0, WAIT)
    finally:
        pool.stop()


# ------------------------------------------------------------------ the real daemon

NOBODY = ["setpriv", "--regid=65534", "--clear-groups"]
PY = shutil.which("python3", path="/usr/bin:/bin")

# uid 65534 sends its binds (each needs npu-smi's process table: no NPU is named) on
# separate connections, says "sent", then prints each status line as it comes
_HOG = r"""
import socket, sys
n, path = int(sys.argv[1]), sys.argv[2]
body = b"{}"
req = (b"POST /v1/bind HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
       + str(len(body)).encode() + b"\r\n\r\n" + body)
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(req)
    socks.append(s)
print("sent", flush=True)
for s in socks:
    s.settimeout(120)
    raw = b""
    while chunk := s.recv(65536):
        raw += chunk
    print(raw.split(b"\r\n", 1)[0].decode(), flush=True)
"""

_HEALTH = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
t0 = time.monotonic()
s.connect(sys.argv[1])
s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
s.settimeout(60)
raw = b""
while chunk := s.recv(65536):
    raw += chunk
print(raw.split(b"\r\n", 1)[0].decode(), round(time.monotonic() - t0, 3))
"""


_BIND_PID_1 = _HEALTH.replace('b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"',
                              'b"POST /v1/bind HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 10\\r\\n\\r\\n{\\"pid\\": 1}"')


def _ask(script: str, sock: str, *prefix: str) -> list[str]:
    """The words of ``script``'s one line (status line and seconds), run as ``prefix`` says."""
    return subprocess.run([*prefix, PY, "-c", script, sock], capture_output=True, text=True, timeout=90,
                          cwd="/").stdout.split()


def _all_answered_503(hog: subprocess.Popen, n: int) -> None:
    """Nothing is lost: each of the hog's binds is answered once the hung run times out."""
    statuses = [hog.stdout.readline().split()[1:2] for _ in range(n)]
    assert all(s == ["503"] for s in statuses), statuses


@pytest.fixture
def slow_table_daemon():
    fake: list[HangingNpuSmi] = []

    def env(directory):
        fake.append(HangingNpuSmi(directory))
        os.chmod(fake[0].dir, 0o755)
        return {"ASCENDBIND_NPU_SMI": str(fake[0].path), "ASCENDBIND_COMMAND_TIMEOUT_SECONDS": "8"}

    with public_daemon("ascendbind-fair-", env) as d:
        os.chmod(d.sock, 0o666)
        yield d, fake[0]


@pytest.mark.skipif(PY is None or shutil.which("setpriv") is None, reason="needs /usr/bin/python3 and setpriv")
def test_another_uids_and_roots_healthz_answer_while_one_uid_keeps_eight_binds_waiting(slow_table_daemon):
    daemon, fake = slow_table_daemon
    hog_binds = API_LIMITS.workers + 2  # more than every shared thread
    assert hog_binds <= API_LIMITS.per_peer
    calls_before = len(fake.calls())
    fake.hang("info")  # the host is discovered already; only the process table runs from now on
    hog = subprocess.Popen([*NOBODY, "--reuid=65534", PY, "-c", _HOG, str(hog_binds), daemon.sock],
                           stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert hog.stdout.readline().strip() == "sent"
        # the hog's binds reached the daemon and wait on the one hung process-table run
        assert wait_for(lambda: fake.hung_runs() == 1, 30), daemon.log()[-2000:]
        for who in ([*NOBODY, "--reuid=65533"], []):
            line = _ask(_HEALTH, daemon.sock, *who)
            assert line[:2] == ["HTTP/1.1", "200"], (who, line)
            assert float(line[-1]) < 1.0, (who, line)
        # and a bind of another uid is not queued behind the hog either: it is refused at once
        # (not permitted: it names a process it does not own), not after the hung run
        out = _ask(_BIND_PID_1, daemon.sock, *NOBODY, "--reuid=65533")
        assert out[:2] == ["HTTP/1.1", "403"] and float(out[-1]) < 1.0, out
        _all_answered_503(hog, hog_binds)
    finally:
        fake.answer()
        if hog.poll() is None:
            hog.kill()
        hog.wait()
    assert Client(daemon.sock, timeout=30).health()["status"] in ("ok", "degraded")
    assert fake.calls()[calls_before:] == ["info"], fake.calls()  # one shared run, not one per bind


@pytest.mark.skipif(PY is None or shutil.which("unshare") is None, reason="needs /usr/bin/python3 and unshare")
def test_root_in_a_container_cannot_take_the_host_roots_threads_and_healthz_needs_none(slow_table_daemon):
    daemon, fake = slow_table_daemon
    hog_binds = API_LIMITS.root_workers + 4
    fake.hang("info")
    # root in a PID namespace of its own, as a container's entry point is
    hog = subprocess.Popen(["unshare", "--pid", "--fork", PY, "-c", _HOG, str(hog_binds), daemon.sock],
                           stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert hog.stdout.readline().strip() == "sent"
        assert wait_for(lambda: fake.hung_runs() == 1, 30), daemon.log()[-2000:]
        line = _ask(_HEALTH, daemon.sock)
        assert line[:2] == ["HTTP/1.1", "200"] and float(line[-1]) < 1.0, line
        # the host's root gets a thread of its own: refused at once (pid 1 is never a worker),
        # not queued behind the container's binds until the hung run ends
        line = _ask(_BIND_PID_1, daemon.sock)
        assert line[:2] == ["HTTP/1.1", "403"] and float(line[-1]) < 1.0, line
        _all_answered_503(hog, hog_binds)
    finally:
        fake.answer()
        if hog.poll() is None:
            hog.kill()
        hog.wait()


def test_healthz_answered_on_the_loop_closes_each_connection_at_once(slow_table_daemon):
    daemon, _fake = slow_table_daemon
    fds = lambda: len(os.listdir(f"/proc/{daemon.pid}/fd"))  # noqa: E731
    before = fds()
    client = Client(daemon.sock, timeout=30)
    for _ in range(300):
        assert client.health()["workers"] == 0
    # each answered connection is closed as it is answered, not kept until a deadline: a client
    # polling fast never fills the connection cap (it did, at 128 open, when they lingered)
    assert fds() <= before + 4, (before, fds())
