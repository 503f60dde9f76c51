"""Workers that make what the daemon reads of them hard to read, for real.

    with unserved_fuse_dev() as w:        # its /dev is a FUSE mount nobody serves
        w.pid                              # (tests/containers.py's contained worker)
    with raw_environ_worker(["A=5", "A=3"]) as (w, getenv):   # exec'd with exactly that list
        getenv                             # what the worker's own getenv("A") returned
    with rewritten_environ_worker(6 << 20) as w:   # one multi-MB ASCEND_VISIBLE_DEVICES

``unserved_fuse_dev``: the worker (pid 1 of its own mount and pid namespace) opens
``/dev/fuse`` and mounts it on its ``/dev`` with the kernel's raw interface
(``mount(2)`` type ``fuse``, ``fd=N,rootmode=40000,user_id=0,group_id=0``), then never
reads the descriptor: the connection's INIT is never answered, so every access to
that ``/dev`` from outside waits, killably, until the worker exits and its
descriptor closes (the kernel then aborts the connection: ENOTCONN). The mount
lives in the worker's private mount namespace and goes with it; the host's mount
table never sees it.

``raw_environ_worker``: a launcher calls ``execve(2)`` itself with the entries as
given (Python's ``os.execve`` takes a dict, so it cannot repeat a key); ``pads``
more entries of ``pad_size`` bytes each make the environment as large as asked,
with the stack limit raised so that the kernel's argument limit (a quarter of it,
at most 6 MiB) lets it through. ``rewritten_environ_worker`` is exec'd that way, then
writes one ``ASCEND_VISIBLE_DEVICES=0-4096,0-4096,…`` over its whole environment
area through ``/proc/self/mem`` (a single value longer than ``execve`` allows one
string to be), as a hostile worker can.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence

from tests.containers import contained_worker
from tests.workers import _CHILD, PipeChild, reap

__all__ = ["unserved_fuse_dev", "raw_environ_worker", "rewritten_environ_worker", "FUSE_DEV"]

# runs first in the contained worker, then tests/workers.py's worker; the descriptor stays
# open and unread for the worker's life
FUSE_DEV = r"""
import ctypes, os, stat
_libc = ctypes.CDLL(None, use_errno=True)
os.mknod("/dev/.fuse", stat.S_IFCHR | 0o600, os.makedev(10, 229))
_fuse_fd = os.open("/dev/.fuse", os.O_RDWR)
_opts = f"fd={_fuse_fd},rootmode=40000,user_id=0,group_id=0".encode()
if _libc.mount(b"unserved", b"/dev", b"fuse", 0, _opts) != 0:
    raise SystemExit(f"mount fuse on /dev: errno {ctypes.get_errno()}")
"""


@contextlib.contextmanager
def unserved_fuse_dev(*, env: dict[str, str] | None = None, major: int | None = None,
                      devices: Sequence[tuple[str, int]] = ()) -> Iterator:
    """A contained worker whose ``/dev`` is a FUSE mount nobody serves (see above)."""
    with contained_worker(devices, env=env, major=major,
                          program=["-c", FUSE_DEV + _CHILD, "worker_0", "acl_thread"]) as w:
        yield w


# execve(2) with a raw environment list; stack limit raised first (the argument limit follows it)
_EXEC_RAW = r"""
import ctypes, json, resource, sys
spec = json.loads(sys.argv[1])
if spec["stack"]:
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    soft = spec["stack"] if hard == resource.RLIM_INFINITY else min(spec["stack"], hard)
    resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))
env = [e.encode() for e in spec["env"]]
env += [f"PAD{i}=".encode() + b"x" * spec["pad_size"] for i in range(spec["pads"])]
argv = [sys.executable.encode(), b"-c", spec["program"].encode()]
def array(items):
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)
libc = ctypes.CDLL(None, use_errno=True)
libc.execve(argv[0], array(argv), array(env))
sys.exit(f"execve: errno {ctypes.get_errno()}")
"""

# prints what its own getenv(3) says of the key, then waits for stdin to close
_GETENV = r"""
import ctypes, sys
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
value = libc.getenv(%r)
sys.stdout.write(("unset" if value is None else "=" + value.decode()) + "\nready\n"); sys.stdout.flush()
sys.stdin.read()
"""

# overwrites its whole environment area (env_start..env_end of /proc/self/stat) with one entry
_REWRITE = r"""
import sys
with open("/proc/self/stat") as fh:
    fields = fh.read().rpartition(")")[2].split()
env_start, env_end = int(fields[47]), int(fields[48])   # fields 50 and 51
head = b"ASCEND_VISIBLE_DEVICES="
size = env_end - env_start
body = (b"0-4096," * (size // 7 + 1))[: size - len(head) - 1]
with open("/proc/self/mem", "r+b", buffering=0) as mem:
    mem.seek(env_start)
    mem.write(head + body + b"\0")
sys.stdout.write(f"{size}\nready\n"); sys.stdout.flush()
sys.stdin.read()
"""


def _spawn(program: str, env: Sequence[str], *, pads: int = 0, pad_size: int = 0,
           stack: int = 0) -> subprocess.Popen:
    spec = {"program": program, "env": list(env), "pads": pads, "pad_size": pad_size, "stack": stack}
    proc = subprocess.Popen([sys.executable, "-c", _EXEC_RAW, json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc


@contextlib.contextmanager
def raw_environ_worker(env: Sequence[str], key: str, *, pads: int = 0,
                       pad_size: int = 0) -> Iterator[tuple[PipeChild, str]]:
    """A worker exec'd with exactly ``env`` (then ``pads`` padding entries), and what its own
    getenv(``key``) returned: ``=value``, or ``unset``."""
    proc = _spawn(_GETENV % key.encode(), env, pads=pads, pad_size=pad_size, stack=64 << 20 if pads else 0)
    try:
        assert proc.stdout
        seen = proc.stdout.readline().rstrip("\n")
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"raw-environ worker did not start: {seen!r}")
        yield PipeChild(proc), seen
    finally:
        reap(proc)


@contextlib.contextmanager
def rewritten_environ_worker(size: int) -> Iterator[tuple[PipeChild, int]]:
    """A worker whose environment area (about ``size`` bytes, at most what execve takes: some
    6 MiB) holds one ``ASCEND_VISIBLE_DEVICES`` value of ranges; yields it and the area's size."""
    pad = 128_000  # under the kernel's 128 KiB limit on one string
    proc = _spawn(_REWRITE, [], pads=max(1, size // (pad + 8)), pad_size=pad, stack=64 << 20)
    try:
        assert proc.stdout
        written = proc.stdout.readline().strip()
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"environ-rewriting worker did not start: {written!r}")
        yield PipeChild(proc), int(written)
    finally:
        reap(proc)
