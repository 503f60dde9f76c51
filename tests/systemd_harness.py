"""systemd as PID 1 for the service tests: this machine's own systemd, booted in a container.

    venv = opt_venv()                       # the checkout installed as /opt/ascendbind
    with booted(tmp, binds) as c:           # systemd-nspawn -b over a tmpfs root, the host's /usr
        c.run(["systemctl", "enable", "--now", "ascendbind.socket"])
        c.show("ascendbind.service", "ActiveState")      # {"ActiveState": "inactive"}
        c.path("/run/ascendbind/ascendbind.sock")         # the same file, seen from here
        with c.worker(plain=1) as w: ...                  # a worker process inside it
    # leaving the block powers the container off (SIGKILL to its PID 1 if that hangs)

The container is ``systemd-nspawn --directory=/ --volatile=yes --register=no
--keep-unit -b -- systemd.firstboot=off systemd.unit=multi-user.target``: a
tmpfs root with the host's ``/usr`` read-only, its own pid namespace, the
host's network. ``--keep-unit`` because no system bus runs here for nspawn to
register a scope with. Everything the tests need comes in with ``--bind``.

* A preset file that disables every unit: a first boot (empty ``/etc``)
  enables every unit by preset, and the packages installed here (prometheus,
  irqbalance, ...) would start inside, on the host's network and IRQs.
* The host's ``/etc/ld.so.cache``: without it (the empty ``/etc``)
  ``ctypes.util.find_library`` finds no libudev and the daemon would run
  without hot-plug, which a real host never does.
* nspawn mounts ``/proc/irq`` read-only, and its PID 1 gets no CAP_NET_ADMIN
  without a private network; the harness gives it the capability and makes
  ``/proc/irq`` writable again in the container's mount namespace before any
  service starts, so the unit's own settings decide, as on a host.

The daemon's interpreter must be one the unit can see: ``ProtectHome=yes``
hides ``/root`` and ``/home``, ``PrivateTmp=yes`` hides ``/tmp``, and the tmpfs
root hides everything but ``/usr``. ``opt_venv`` installs the checkout with the
distribution's Python (``/usr/bin/python3``) into a venv whose path is
``/opt/ascendbind``, as ``make install-service`` documents; it is built once
per source version under ``.venv/`` in a private mount namespace (so the
host's ``/opt`` is never touched) and bound at ``/opt/ascendbind`` read-only.

Commands run inside through ``nsenter --all`` into the container's PID 1.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.deploy_tools import missing, running
from tests.workers import _CHILD, Worker

ROOT = Path(__file__).resolve().parent.parent
OPT = "/opt/ascendbind"
SYSTEM_PYTHON = "/usr/bin/python3"
TOOLS = ("systemd-nspawn", "nsenter", "unshare", "mount", "make", "systemctl")
_NSPAWN_RUN = Path("/run/systemd")


def need_tools() -> None:
    """Skip (a developer's machine) or fail (CI) unless root and every tool is here."""
    if os.geteuid() != 0:
        missing("root (systemd-nspawn)")
    for tool in TOOLS:
        if shutil.which(tool) is None:
            missing(f"{tool} (Debian packages systemd-container, util-linux, mount, make)")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        missing(f"{SYSTEM_PYTHON} (Debian package python3)")


# ---------------------------------------------------------------- the installed command


def _source_key() -> str:
    h = hashlib.sha256()
    h.update(subprocess.run([SYSTEM_PYTHON, "-VV"], capture_output=True, text=True, check=True).stdout.encode())
    files = [ROOT / "pyproject.toml", ROOT / "MANIFEST.in"]
    files += sorted(p for p in (ROOT / "ascendbind").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def opt_venv() -> Path:
    """A venv of the distribution's Python with this checkout installed, built for the path
    /opt/ascendbind (its scripts' ``#!`` lines name it); rebuilt when the source changes."""
    cache = ROOT / ".venv" / "opt-ascendbind"
    key = _source_key()
    cache.parent.mkdir(exist_ok=True)
    with open(cache.parent / "opt-ascendbind.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = cache / ".source-key"
        if stamp.exists() and stamp.read_text() == key:
            return cache
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()
        with tempfile.TemporaryDirectory(prefix="ascendbind-wheels-") as wheels:
            # the checkout's wheel and its dependencies', with the test venv's pip and setuptools
            subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "pip", "wheel", "-q",
                            "--no-build-isolation", "--wheel-dir", wheels, str(ROOT)],
                           check=True, cwd=str(ROOT), timeout=600)
            # /opt is a fresh tmpfs only in this private mount namespace: the host's stays as it is
            script = ('mount -t tmpfs -o mode=0755 tmpfs /opt && mkdir /opt/ascendbind '
                      '&& mount --bind "$1" /opt/ascendbind '
                      f'&& {SYSTEM_PYTHON} -m venv --without-pip /opt/ascendbind '
                      '&& "$3" -m pip --isolated -q --python /opt/ascendbind/bin/python install '
                      '--no-index --find-links "$2" ascendbind')
            subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script,
                            "sh", str(cache), wheels, os.path.join(ROOT, ".venv", "bin", "python")],
                           check=True, timeout=600)
        stamp.write_text(key)
        return cache


# ---------------------------------------------------------------- the container


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


def _wait(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _paths_under(top: Path) -> set[Path]:
    if not top.exists():
        return set()
    return {top} | {Path(d) / n for d, dirs, files in os.walk(top) for n in dirs + files}


class Container:
    """``os_root`` None: this machine's systemd over a tmpfs root and its own ``/usr``.
    A directory (an older Debian, tests/debian_roots.py): that tree's systemd and
    userland, read-only under a tmpfs overlay (``--volatile=overlay``: the tree need
    not have a merged ``/usr``, and stays as it was), with its own ``ld.so.cache``."""

    def __init__(self, directory: Path, binds: list[tuple[str, str, bool]], os_root: Path | None = None) -> None:
        self.dir = directory
        self.name = f"abtest{os.getpid()}x{time.monotonic_ns() % 100000}"
        preset = directory / "00-ascendbind-test.preset"
        preset.write_text("disable *\n")
        binds = [*binds, (str(preset), "/etc/systemd/system-preset/00-ascendbind-test.preset", True)]
        if os_root is None and os.path.exists("/etc/ld.so.cache"):
            binds.append(("/etc/ld.so.cache", "/etc/ld.so.cache", True))
        tree = ["--directory=/", "--volatile=yes"] if os_root is None else [f"--directory={os_root}",
                                                                            "--volatile=overlay"]
        self.argv = ["systemd-nspawn", *tree, "--register=no", "--keep-unit",
                     "--quiet", "--console=read-only", f"--machine={self.name}", "--capability=CAP_NET_ADMIN"]
        self.argv += [f"--bind{'-ro' if ro else ''}={src}:{dst}" for src, dst, ro in binds]
        self.argv += ["-b", "--", "systemd.firstboot=off", "systemd.unit=multi-user.target"]
        self.log_path = directory / "nspawn.log"
        self.proc: subprocess.Popen | None = None
        self.leader = 0
        self._before = _paths_under(_NSPAWN_RUN)

    def boot(self, timeout: float = 120.0) -> Container:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

        own_ns = os.readlink("/proc/self/ns/pid")

        def leader() -> int:
            # nspawn's first child (its "outer child") forks the container's PID 1 and exits;
            # PID 1 is the child in another pid namespace that has become systemd
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited {self.proc.returncode}:\n{self.log()}")
            for pid in _children(self.proc.pid):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/ns/pid") != own_ns and \
                            Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                        return pid
            return 0

        self.leader = _wait(leader, timeout, "the container's PID 1")

        def booted() -> bool:
            if leader() != self.leader:
                raise RuntimeError(f"the container's PID 1 {self.leader} is gone:\n{self.log()}")
            r = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=timeout)
            return r.stdout.strip() in ("running", "degraded")

        try:
            _wait(booted, timeout, "the boot to finish", interval=0.2)
        except AssertionError as exc:
            jobs = self.run(["systemctl", "list-jobs", "--no-legend"], check=False).stdout
            raise AssertionError(f"{exc}; jobs still queued:\n{jobs}\n{self.log()[-3000:]}") from None
        # as on a host: /proc/irq writable unless the unit itself says otherwise
        self.run(["mount", "-o", "remount,bind,rw,nosuid,nodev,noexec", "/proc/irq"])
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def nsenter(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--target={self.leader}", "--all", "--", *argv]

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
        r = subprocess.run(self.nsenter(argv), input=input, capture_output=True, text=True, timeout=timeout,
                           env=env)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
        return r

    def path(self, path: str) -> str:
        """``path`` inside the container, as seen from the host."""
        return f"/proc/{self.leader}/root{path}"

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_unit(self, unit: str, timeout: float = 60.0, **want) -> dict[str, str]:
        """Poll ``systemctl show`` until every property has the wanted value (a string, or a
        predicate of the value); returns those properties and a few more."""
        def seen() -> dict[str, str] | None:
            state = self.show(unit, *want, "MainPID", "NRestarts", "Result", "StatusText")
            ok = all(v(state.get(k)) if callable(v) else state.get(k) == v for k, v in want.items())
            return state if ok else None

        try:
            return _wait(seen, timeout, f"{unit} {want}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; journal:\n{self.journal(unit)[-3000:]}") from None

    def journal(self, unit: str) -> str:
        return self.run(["journalctl", "--no-pager", "-o", "cat", "-u", unit], check=False).stdout

    def host_pid(self, guest_pid: int) -> int:
        """The host's pid of a process of the container (by its NSpid)."""
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{name}/status").read_text().splitlines():
                    if line.startswith("NSpid:"):
                        ids = line.split()[1:]
                        if len(ids) > 1 and int(ids[-1]) == guest_pid and self._ours(int(name)):
                            return int(name)
        raise LookupError(f"no host pid for container pid {guest_pid}")

    def _ours(self, pid: int) -> bool:
        with contextlib.suppress(OSError):
            return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{self.leader}/ns/pid")
        return False

    @contextlib.contextmanager
    def worker(self, plain: int = 2, acl: int = 1, release: int = 1) -> Iterator[GuestWorker]:
        names = [f"worker_{i}" for i in range(plain)] + ["acl_thread"] * acl + ["release_thread"] * release
        proc = subprocess.Popen(self.nsenter([SYSTEM_PYTHON, "-c", _CHILD, *names]), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        w = None
        try:
            assert proc.stdout.readline().strip() == "ready"
            w = GuestWorker(self, proc)
            yield w
        finally:
            if w is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
            # nsenter reaps its child and exits; killed first, it would leave the child a zombie
            # whose new parent is outside the container, and shutdown would wait for it
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
            for fh in (proc.stdin, proc.stdout):
                fh.close()

    def shutdown(self, timeout: float = 60.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nspawn asks PID 1 to power off
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # the kernel kills every process of the container's pid namespace with its PID 1
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.leader, signal.SIGKILL)
                self.proc.wait(timeout=30)
        # what nspawn leaves under /run/systemd on a host without systemd: our machine's, empty dirs
        for path in sorted(_paths_under(_NSPAWN_RUN) - self._before, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else None


class GuestWorker(Worker):
    """tests/workers.py's worker, started inside the container: ``pid`` is the host's view
    (its /proc/<pid>/task masks are read from here), ``guest_pid`` the container's (what its
    daemon is asked to bind)."""

    def __init__(self, container: Container, proc: subprocess.Popen) -> None:
        self.proc = proc
        kids = _wait(lambda: _children(proc.pid), 30, "nsenter's child")
        self.pid = kids[0]
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                self.guest_pid = int(line.split()[-1])
        with open(f"/proc/{self.pid}/stat") as fh:
            self.start_time = int(fh.read().rpartition(")")[2].split()[19])


@contextlib.contextmanager
def booted(directory: Path, binds: list[tuple[str, str, bool]], os_root: Path | None = None) -> Iterator[Container]:
    c = Container(directory, binds, os_root)
    with running(c, c.boot, c.shutdown):
        yield c
