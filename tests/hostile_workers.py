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

``thread_flood_worker``: a worker that starts, names and ends threads as fast as it
can once told to (``flood(True)``): each of ``creators`` threads starts a thread
that names itself ``acl_thread_<n>`` with ``prctl(PR_SET_NAME)`` (a rename into the
ACL role) and returns, joins it, and starts the next; every thread is three process
events (fork, comm, exit). ``started()`` counts the threads started so far;
``rename(tid, name)`` has it rename one of its own threads (the Python flooder). In
Python (about 10,000 threads a second on 2 CPUs), or ``native=True`` the same loop in
C, compiled with the host's ``cc`` (several times faster; ``LookupError`` without one).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence

from tests.containers import contained_worker
from tests.threadname import program
from tests.workers import _CHILD, PipeChild, reap

__all__ = ["unserved_fuse_dev", "raw_environ_worker", "rewritten_environ_worker", "FUSE_DEV", "thread_flood_worker",
           "FloodWorker"]

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


# stdin: "on" / "off" (answered "ok" once the creators run / have stopped), "count" (threads
# started so far); the creators wait on a condition while off
_FLOOD_PY = program(r"""
import ctypes, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
NAMES = [f"acl_thread_{i}".encode() for i in range(16)]
def body(name):
    libc.prctl(PR_SET_NAME, name, 0, 0, 0)  # name_self's call without its checks: this is the hot loop
cond = threading.Condition()
want, running, started = False, 0, 0
def creator():
    global running, started
    i = 0
    while True:
        with cond:
            running -= 1
            cond.notify_all()
            cond.wait_for(lambda: want)
            running += 1
        for _ in range(64):
            t = threading.Thread(target=body, args=(NAMES[i & 15],), daemon=True)
            t.start(); t.join(); i += 1
        with cond:
            started += 64
n = int(sys.argv[1])
running = n
for _ in range(n):
    threading.Thread(target=creator, daemon=True).start()
with cond:
    cond.wait_for(lambda: running == 0)
out = sys.stdout
out.write("ready\n"); out.flush()
for line in sys.stdin:
    cmd = line.strip()
    with cond:
        if cmd in ("on", "off"):
            want = cmd == "on"
            cond.notify_all()
            cond.wait_for(lambda: running == (n if want else 0))
            out.write("ok\n")
        elif cmd == "count":
            out.write(f"{started}\n")
        elif cmd.startswith("rename "):
            _, tid, name = cmd.split()
            with open(f"/proc/self/task/{tid}/comm", "w") as fh:
                fh.write(name[:15])
            out.write("ok\n")
        else:
            out.write("?\n")
    out.flush()
""")

_FLOOD_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int want, running;
static unsigned long started;
static char names[16][16];
static void *body(void *name) { prctl(PR_SET_NAME, (char *)name, 0, 0, 0); return NULL; }
static void *creator(void *unused) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    for (unsigned long i = 0;;) {
        pthread_mutex_lock(&mu);
        running--; pthread_cond_broadcast(&cv);
        while (!want) pthread_cond_wait(&cv, &mu);
        running++; pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
        for (int k = 0; k < 64; k++, i++) {
            pthread_t t;
            if (pthread_create(&t, &attr, body, names[i & 15]) == 0) pthread_join(t, NULL);
        }
        __atomic_add_fetch(&started, 64, __ATOMIC_RELAXED);
    }
    return unused;
}
int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    char line[64];
    for (int i = 0; i < 16; i++) snprintf(names[i], 16, "acl_thread_%d", i);
    running = n;
    for (int i = 0; i < n; i++) { pthread_t t; pthread_create(&t, NULL, creator, NULL); }
    pthread_mutex_lock(&mu);
    while (running) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        if (!strcmp(line, "on\n") || !strcmp(line, "off\n")) {
            pthread_mutex_lock(&mu);
            want = line[1] == 'n';
            pthread_cond_broadcast(&cv);
            while (running != (want ? n : 0)) pthread_cond_wait(&cv, &mu);
            pthread_mutex_unlock(&mu);
            printf("ok\n");
        } else if (!strcmp(line, "count\n")) {
            printf("%lu\n", __atomic_load_n(&started, __ATOMIC_RELAXED));
        } else {
            printf("?\n");
        }
    }
    return 0;
}
"""


class FloodWorker(PipeChild):
    """A worker that floods the host with thread events on command (see above)."""

    def flood(self, on: bool) -> None:
        """Start (or stop, returning once no creator runs) the thread flood."""
        self._ask("on" if on else "off")

    def started(self) -> int:
        """Threads started since the worker began (counted in batches of 64 per creator)."""
        return int(self._ask("count"))


def _native_flooder(directory: str) -> list[str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise LookupError("no C compiler (cc) on this host")
    src, exe = os.path.join(directory, "flood.c"), os.path.join(directory, "flood")
    with open(src, "w") as fh:
        fh.write(_FLOOD_C)
    subprocess.run([cc, "-O2", "-pthread", "-o", exe, src], check=True, capture_output=True, timeout=120)
    return [exe]


@contextlib.contextmanager
def thread_flood_worker(creators: int = 2, *, native: bool = False) -> Iterator[FloodWorker]:
    """A worker with ``creators`` threads that flood thread events while told to; always reaped."""
    with tempfile.TemporaryDirectory(prefix="ascendbind-flood-") as directory:
        argv = _native_flooder(directory) if native else [sys.executable, "-c", _FLOOD_PY]
        proc = subprocess.Popen([*argv, str(creators)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("thread-flood worker did not start")
            yield FloodWorker(proc)
        finally:
            reap(proc)
