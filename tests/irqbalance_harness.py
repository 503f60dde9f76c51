"""A real irqbalance for the tests, started and stopped by them; never the host's.

Each irqbalance runs in the foreground as a child of the test, with a policy
script that bans every IRQ of this host (``ban=true``): a balancing pass would
otherwise move real IRQs while other tests on this machine read and write their
masks. Policy bans are not on the ban list the control socket reads and
replaces, so that list starts as the command line's ``--banirq`` set. Every
``/proc/irq/*/smp_affinity`` is recorded before it starts and written back after
it stops, whatever happened.

``own_run=True`` (the default) gives it a private /run (tests/irqbalance_ns.py):
its socket is then ``/run/irqbalance/irqbalance<pid>.sock`` in its own mount
namespace, as under systemd. ``own_run=False`` runs it plainly, so it binds the
one abstract address every irqbalance falls back to; those runs take a file
lock so that two of them never meet.

``RawClient`` speaks to irqbalance with its own few lines of socket code (not
ascendbind's): it plays "someone else" setting bans, and reads the list back.
A missing irqbalance skips the test here and fails it in CI (``CI=true``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import write_once
from tests.daemon_harness import Spawned, wait_for
from tests.deploy_tools import missing

ROOT = Path(__file__).resolve().parent.parent
ABSTRACT_LOCK = "/tmp/ascendbind-tests-irqbalance-abstract.lock"
# held by every test that records this machine's IRQ masks and writes them back afterwards
# (irqbalance runs, isolation's real IRQs): two such tests of different sessions side by side
# would each record what the other changed, and put it back after the other had restored
IRQ_MASKS_LOCK = "/tmp/ascendbind-tests-irq-masks.lock"
ABSTRACT_NAME = "@" * 108  # how /proc/net/unix prints 108 NUL bytes


def irqbalance_binary() -> str:
    path = shutil.which("irqbalance") or next(
        (p for p in ("/usr/sbin/irqbalance", "/sbin/irqbalance") if os.access(p, os.X_OK)), None)
    if path is None:
        missing("irqbalance (Debian package irqbalance)")
    if os.geteuid() != 0 or not os.access("/proc/irq", os.W_OK):
        pytest.skip("irqbalance needs root and a writable /proc/irq")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("irqbalance exits at once on one CPU")
    return path  # type: ignore[return-value]


def irqbalance_version() -> str:
    out = subprocess.run([irqbalance_binary(), "--version"], capture_output=True, text=True, timeout=30)
    return (out.stdout + out.stderr).strip()


def irq_masks() -> dict[int, str]:
    masks = {}
    for name in os.listdir("/proc/irq"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                masks[int(name)] = Path(f"/proc/irq/{name}/smp_affinity").read_text().strip()
    return masks


def restore_irq_masks(saved: dict[int, str]) -> None:
    for irq, text in saved.items():
        with contextlib.suppress(OSError):
            if Path(f"/proc/irq/{irq}/smp_affinity").read_text().strip() == text:
                continue
            write_once(f"/proc/irq/{irq}/smp_affinity", text)


def listening_names(pid: int) -> list[str]:
    """Names of the listening Unix sockets ``pid`` holds (from /proc/net/unix)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    names = []
    with open("/proc/net/unix") as fh:
        next(fh)
        for line in fh:
            parts = line.split()
            # Flags 00010000 = __SO_ACCEPTCON: a socket that listen() was called on
            if len(parts) >= 8 and parts[6] in inodes and parts[3] == "00010000":
                names.append(parts[7])
    return names


def _abstract_taken() -> bool:
    with open("/proc/net/unix") as fh:
        return any(line.split()[-1] == ABSTRACT_NAME for line in fh if len(line.split()) >= 8)


def take_abstract_lock() -> int:
    """A descriptor holding the lock on irqbalance's abstract address (closing it releases it)."""
    return _flock(ABSTRACT_LOCK, "irqbalance's abstract address", 120)


def _flock(path: str, what: str, patience: float = 300) -> int:
    """A descriptor holding an exclusive lock on ``path`` (made if missing), taken within
    ``patience`` seconds or the test fails."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def take() -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    if not wait_for(take, patience):
        os.close(fd)
        pytest.fail(f"{path} ({what}) stayed locked for {patience:g} s")
    return fd


@contextlib.contextmanager
def irq_masks_lock():
    """Held while a test changes this machine's IRQ masks and puts them back (see IRQ_MASKS_LOCK)."""
    fd = _flock(IRQ_MASKS_LOCK, "the IRQ masks")
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def abstract_address_lock():
    """Held while a test uses irqbalance's one abstract address."""
    fd = take_abstract_lock()
    try:
        yield
    finally:
        os.close(fd)


class Irqbalance(Spawned):
    def __init__(self, tmp_path: Path, *, banirq=(), own_run: bool = True, interval: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.banirq = tuple(banirq)
        self.own_run = own_run
        self.interval = interval  # seconds between its passes (--interval); its default is 10
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.lock_fd: int | None = None
        self.masks_fd: int | None = None
        self.saved_masks: dict[int, str] = {}

    def start(self) -> Irqbalance:
        exe = irqbalance_binary()
        if self.own_run and shutil.which("unshare") is None:
            missing("unshare (util-linux)")
        policy = self.tmp_path / "ban-every-irq"
        policy.write_text("#!/bin/sh\necho ban=true\n")
        policy.chmod(0o755)
        argv = [exe, "--foreground", f"--policyscript={policy}", *(f"--banirq={i}" for i in self.banirq),
                *([f"--interval={self.interval}"] if self.interval else [])]
        if self.own_run:
            argv = ["unshare", "--mount", "--propagation", "private", "--", sys.executable,
                    str(ROOT / "tests" / "irqbalance_ns.py"), *argv]
        else:
            self._lock()
            if _abstract_taken():
                self.stop()
                pytest.skip("another process holds irqbalance's abstract address")
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **self.extra_env}  # no ONESHOT etc.
        self.masks_fd = _flock(IRQ_MASKS_LOCK, "the IRQ masks")
        self.saved_masks = irq_masks()
        self.log = open(self.tmp_path / "irqbalance.log", "w")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if not wait_for(lambda: self.proc.poll() is not None or listening_names(self.pid), 60):
            self.stop()
            pytest.fail("irqbalance did not open its socket within 60 s")
        if self.proc.poll() is not None:
            code = self.proc.returncode
            self.stop()
            pytest.fail(f"irqbalance exited {code}: {(self.tmp_path / 'irqbalance.log').read_text()[-500:]}")
        return self

    def _lock(self) -> None:
        self.lock_fd = take_abstract_lock()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log.close()
        restore_irq_masks(self.saved_masks)
        if self.masks_fd is not None:
            os.close(self.masks_fd)
            self.masks_fd = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None


class RawClient:
    """irqbalance's protocol in a few lines, independent of ascendbind's client."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        path = f"/proc/{self.pid}/root/run/irqbalance/irqbalance{self.pid}.sock"
        try:
            dfd = os.open(os.path.dirname(path), os.O_PATH)
        except OSError:
            s.connect(b"\0" * 108)
        else:
            try:
                s.connect(f"/proc/self/fd/{dfd}/{os.path.basename(path)}")
            finally:
                os.close(dfd)
        return s

    def send(self, command: str) -> str:
        with self._connect() as s:
            s.sendmsg([command.encode()], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS,
                                            struct.pack("3i", os.getpid(), 0, 0))])
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out.decode()

    def banned(self) -> set[int]:
        words = self.send("setup").split()
        return {int(words[i + 1]) for i, w in enumerate(words) if w == "IRQ"}

    def ban(self, irqs) -> None:
        self.send("settings ban irqs " + (" ".join(map(str, sorted(irqs))) or "NONE"))


def fixture_proc_link(proc: Path, pid: int) -> None:
    """Make ``<proc>/<pid>`` the real /proc/<pid> in a fixture proc tree."""
    (proc / str(pid)).symlink_to(f"/proc/{pid}")
