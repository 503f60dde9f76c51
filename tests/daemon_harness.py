"""A real ``ascendbind serve`` process for the daemon tests.

    with running_daemon(tmp_dir, extra_env) as d:
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        d.client.workers(); d.metrics_text(); d.log()
    # leaving the block always kills the daemon (SIGKILL after a grace period)

The daemon runs with this environment: ASCENDBIND_SOCKET,
ASCENDBIND_STATE_DIR, ASCENDBIND_METRICS_LISTEN on a free 127.0.0.1 port,
ASCENDBIND_RECONCILE_SECONDS=1, ASCENDBIND_SMALL_POOL=share, and PATH with
fixtures/bin first (the fake one-NPU npu-smi). ASCENDBIND_CONFIG="" keeps a host
/etc/ascendbind/config.toml out of the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ascendbind.client import Client

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_BIN = ROOT / "fixtures" / "bin"
# in a QEMU guest (tests/numa_guest.py, tests/arm64_guest.py) Python runs tens of times
# slower than on a host: the waits for a daemon's answers stretch by as much
PATIENCE = 40.0 if os.environ.get("NUMA_GUEST_TOPOLOGY") else 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(sock: str, state_dir: str, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCENDBIND_", "NOTIFY_SOCKET", "LISTEN_",
                                                                     "WATCHDOG_", "JOURNAL_STREAM"))}
    env.update(
        ASCENDBIND_SOCKET=sock,
        ASCENDBIND_STATE_DIR=state_dir,
        ASCENDBIND_METRICS_LISTEN=f"127.0.0.1:{port}",
        ASCENDBIND_RECONCILE_SECONDS="1",
        ASCENDBIND_SMALL_POOL="share",
        ASCENDBIND_CONFIG="",
        PATH=f"{FIXTURE_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


class Spawned:
    """A process a test starts and stops; ``proc`` while it runs."""

    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


class DaemonProc(Spawned):
    def __init__(self, directory: str, env: dict[str, str], argv: list[str] | None = None) -> None:
        self.dir = directory
        self.sock = env["ASCENDBIND_SOCKET"]
        self.state_dir = env["ASCENDBIND_STATE_DIR"]
        self.port = int(env["ASCENDBIND_METRICS_LISTEN"].rpartition(":")[2])
        self.env = env
        self.argv = argv or [sys.executable, "-m", "ascendbind.cli", "serve"]
        self.log_path = os.path.join(directory, f"daemon-{time.monotonic_ns()}.log")
        self.proc: subprocess.Popen | None = None
        self.client = Client(self.sock, timeout=30 * PATIENCE)

    def start(self, *, wait: bool = True) -> DaemonProc:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT))
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 15.0 * PATIENCE) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                self.client.health()
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"daemon did not answer within {timeout}s:\n{self.log()}")

    def wait_discovered(self, timeout: float = 15.0 * PATIENCE) -> None:
        assert wait_for(lambda: self.client.health()["discovery"] == "ok", timeout), self.log()

    def worker_entry(self, pid: int) -> dict:
        """The daemon's ``/v1/workers`` entry for ``pid`` (the request must succeed)."""
        status, body = self.curl("GET", f"/v1/workers?pid={pid}")
        assert status == 200, body
        return body["workers"][0]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            with open(self.log_path) as fh:
                return fh.read()
        except OSError:
            return ""

    def curl(self, method: str, path: str, body=None, *, raw: bytes | None = None,
             prefix: list[str] | None = None, timeout: float = 30 * PATIENCE) -> tuple[int, dict | str]:
        """One request through ``curl --unix-socket``; returns (HTTP status, JSON body or text)."""
        argv = [*(prefix or []), "curl", "-sS", "--max-time", str(timeout), "--unix-socket", self.sock,
                "-X", method, "-o", "-", "-w", "\n%{http_code}"]
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is not None:
            argv += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
        argv.append(f"http://localhost{path}")
        out = subprocess.run(argv, input=data, capture_output=True, timeout=timeout + 5)
        text, _, code = out.stdout.decode().rpartition("\n")
        try:
            payload: dict | str = json.loads(text)
        except ValueError:
            payload = text
        return int(code or 0), payload

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_daemon(directory: str, *, ready_timeout: float = 15.0 * PATIENCE, **extra_env: str) -> Iterator[DaemonProc]:
    env = base_env(os.path.join(directory, "ascendbind.sock"), os.path.join(directory, "state"), free_port(),
                   **extra_env)
    d = DaemonProc(directory, env)
    try:
        d.start(wait=False)
        d.wait_ready(ready_timeout)
        yield d
    finally:
        d.stop()


@contextlib.contextmanager
def kubelet_node(prefix: str) -> Iterator[tuple[DaemonProc, str]]:
    """(daemon, kubelet root): a discovered daemon on the fixture two-NPU host that reads
    kubelet's files (the CPU manager checkpoint) from a kubelet root of its own, for a test
    to write; both removed afterwards."""
    directory = tempfile.mkdtemp(prefix=prefix)
    kubelet = os.path.join(directory, "kubelet")
    os.mkdir(kubelet)
    try:
        with running_daemon(directory, ASCENDBIND_FAKE_NPUS="2", ASCENDBIND_KUBELET_ROOT=kubelet) as d:
            d.wait_discovered()
            yield d, kubelet
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def public_daemon(prefix: str, env=lambda directory: {}) -> Iterator[DaemonProc]:
    """A discovered daemon in a fresh world-traversable directory under /tmp, so a
    test acting as uid 65534 can reach its socket; ``env(directory)`` adds to its
    environment. The directory is removed afterwards."""
    directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(directory, 0o755)
    try:
        with running_daemon(directory, **env(directory)) as d:
            d.wait_discovered()
            yield d
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def survives_and_releases(daemon: DaemonProc) -> None:
    """After each test of a module sharing one daemon: it is alive, and no binding
    is left for the next test (whose order may be shuffled)."""
    assert daemon.alive(), daemon.log()
    daemon.client.release(all=True)


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except Exception:
            pass
        time.sleep(interval)
    return False


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None
