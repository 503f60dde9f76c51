"""Workers as container runtimes leave them, made of the kernel's own namespaces.

    with contained_worker(devices=[("davinci5", 5)], env={"ASCEND_VISIBLE_DEVICES": "5"},
                          allow=[5]) as w:
        w.pid          # its host pid (it is pid 1 of its own pid namespace)
        w.spawn(...), w.threads(), w.cpus_allowed()   # as tests/workers.py's Worker

The worker runs under ``unshare --mount --pid --fork`` with a private tmpfs on
``/dev`` holding ``mknod``-made NPU nodes (``NAME``, minor) of the major the test
picked (``npu_major()``: one no real driver on this machine uses), the environment
given and nothing else of the test's, and with ``allow`` in a cgroup v1 devices
cgroup of its own that lets it open only those minors (what the Ascend runtime
and the device plugin set up). Nothing of it reaches the host: the mount and
pid namespaces go with the process, the cgroup is removed on the way out.

The NPU driver's major comes from ``/proc/devices``; this machine has no driver, so
``daemon_with_driver_major(directory)`` gives the argv prefix that runs a daemon in a
private mount namespace whose ``/proc/devices`` (a file bind-mounted over it, as
lxcfs does) lists ``devdrv-cdev`` with that major.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence

from tests.workers import _CHILD, Worker, _wait, reap

__all__ = ["npu_major", "contained_worker", "daemon_with_driver_major", "DEVICES_CGROUP"]

DEVICES_CGROUP = "/sys/fs/cgroup/devices"

# runs as pid 1 of the new namespaces: a /dev of its own, then the worker's image
_LAUNCH = r"""
import ctypes, json, os, stat, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if libc.mount(b"tmpfs", b"/dev", b"tmpfs", 0, b"mode=0755") != 0:
    sys.exit(f"mount /dev: errno {ctypes.get_errno()}")
for name, major, minor in spec["nodes"]:
    os.mknod(f"/dev/{name}", stat.S_IFCHR | 0o660, os.makedev(major, minor))
if spec["cgroup"]:
    with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as fh:
        fh.write(str(os.getpid()))
# the host procfs is still mounted: /proc/self is the host's pid
sys.stdout.write(f"pid {os.readlink('/proc/self')}\n"); sys.stdout.flush()
os.execve(sys.executable, [sys.executable, *spec["program"]], spec["env"])
"""

_BIND = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_BIND = 4096
if libc.mount(sys.argv[1].encode(), sys.argv[2].encode(), None, MS_BIND, None) != 0:
    sys.exit(f"bind {sys.argv[2]}: errno {ctypes.get_errno()}")
os.execv(sys.argv[3], sys.argv[3:])
"""


def with_bind_mount(source: str, target: str, argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace of its own in which ``source`` is bind-mounted over
    ``target`` (the host's mount table never sees it)."""
    return ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _BIND, source, target, *argv]


def npu_major() -> int:
    """A character major no driver of this machine registered (236, the driver's usual one, if free)."""
    with open("/proc/devices") as fh:
        text = fh.read().split("Block devices:")[0]
    used = {int(line.split()[0]) for line in text.splitlines() if line.strip()[:1].isdigit()}
    return next(m for m in (236, *range(240, 200, -1)) if m not in used)


def _devices_cgroup(minors: Sequence[int], major: int) -> str:
    if not os.path.exists(os.path.join(DEVICES_CGROUP, "devices.list")):
        from tests.deploy_tools import missing

        missing(f"a cgroup v1 devices controller at {DEVICES_CGROUP}")
    path = os.path.join(DEVICES_CGROUP, f"ascendbind-test-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    with open(os.path.join(path, "devices.deny"), "w") as fh:
        fh.write("a")
    for minor in minors:
        with open(os.path.join(path, "devices.allow"), "w") as fh:
            fh.write(f"c {major}:{minor} rw")
    return path


def _remove_cgroup(path: str) -> None:
    def empty() -> bool:
        with open(os.path.join(path, "cgroup.procs")) as fh:
            return not fh.read().strip()

    if _wait(empty):
        os.rmdir(path)


@contextlib.contextmanager
def contained_worker(devices: Sequence[tuple[str, int]] = (), *, env: dict[str, str] | None = None,
                     allow: Sequence[int] | None = None, names: Sequence[str] = ("worker_0", "acl_thread"),
                     major: int | None = None, program: Sequence[str] | None = None,
                     stderr=None, bare: bool = False) -> Iterator[Worker]:
    """A worker in its own mount and pid namespace with ``devices`` as its /dev (see above).
    ``program``: what runs there instead of tests/workers.py's worker (argv after the Python
    interpreter; it must print "ready" and answer one line per command on stdin). ``bare``:
    the same program with the same environment on the bare host (no namespace, no cgroup)."""
    import json

    major = npu_major() if major is None else major
    cgroup = _devices_cgroup(allow, major) if allow is not None and not bare else None
    program = list(program) if program is not None else ["-c", _CHILD, *names]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})}
    spec = {"nodes": [(name, major, minor) for name, minor in devices], "cgroup": cgroup, "program": program,
            "env": env}
    argv = [sys.executable, *program] if bare else [
        "unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private", sys.executable, "-c",
        _LAUNCH, json.dumps(spec)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=env if bare else None)
    worker = None
    try:
        assert proc.stdout
        first = f"pid {proc.pid}" if bare else proc.stdout.readline().strip()
        if not first.startswith("pid "):
            raise RuntimeError(f"contained worker did not start: {first!r}")
        pid = int(first.split()[1])
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("contained worker did not get ready")
        worker = Worker(proc, pid=pid)
        yield worker
    finally:
        # unshare --kill-child: killing unshare kills the worker, pid 1 of its namespace, and the namespace
        reap(proc)
        if cgroup is not None:
            _remove_cgroup(cgroup)


def daemon_with_driver_major(directory: str, major: int) -> list[str]:
    """argv of ``ascendbind serve`` in a mount namespace whose /proc/devices lists devdrv-cdev ``major``."""
    with open("/proc/devices") as fh:
        real = fh.read()
    head, sep, block = real.partition("Block devices:")
    fake = os.path.join(directory, "proc-devices")
    with open(fake, "w") as fh:
        fh.write(head.rstrip("\n") + f"\n{major:3d} devdrv-cdev\n\n{sep}{block}")
    return with_bind_mount(fake, "/proc/devices", [sys.executable, "-m", "ascendbind.cli", "serve"])


FIXTURE_NPU_SMI = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "bin",
                               "npu-smi")


class FakeNpuHost:
    """An npu-smi host a daemon replays (``ASCENDBIND_FIXTURE_HOST=host.dir``), its files made by
    the fixture npu-smi's synthesising mode with ``fake_env`` (ASCENDBIND_FAKE_NPUS, _CHIP,
    _PHY_IDS, _AFFINITY). ``table((pid, npu), ...)`` rewrites the process table; the daemon
    reads it afresh for every bind that does not name its NPU."""

    def __init__(self, directory: str, **fake_env: str) -> None:
        self.dir = directory
        self.env = fake_env
        os.makedirs(os.path.join(directory, "cmd"), exist_ok=True)
        for args in (["info", "-m"], ["info", "-t", "topo"],
                     *(["info", "-t", "board", "-i", str(i)] for i in range(int(fake_env.get("ASCENDBIND_FAKE_NPUS",
                                                                                             "1"))))):
            self._write(args)
        self.table()

    def _write(self, args: list[str], **extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDBIND_")}
        out = subprocess.run([FIXTURE_NPU_SMI, *args], env={**env, **self.env, **extra}, capture_output=True,
                             text=True, check=True, timeout=30).stdout
        path = os.path.join(self.dir, "cmd", "_".join(["npu-smi", *args]) + ".txt")
        with open(path + ".tmp", "w") as fh:
            fh.write(out)
        os.replace(path + ".tmp", path)  # a daemon reading it meanwhile sees the old table or the new

    def table(self, *rows: tuple[int, int]) -> None:
        self._write(["info"], ASCENDBIND_FAKE_NPU_PIDS=",".join(f"{pid}:{npu}" for pid, npu in rows))
