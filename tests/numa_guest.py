"""Run tests (or any command) on a real multi-NUMA kernel: a QEMU guest booted from this
machine's own kernel image over its root file system, read-only (virtme-ng).

    python -m tests.numa_guest                       # tests/numa/ on every guest (2-node, 4-node, isolation)
    python -m tests.numa_guest --topology 2node --repeat 10
    python -m tests.numa_guest --topology 2node -- python bench/memory.py --in-guest

The guest sees the checkout, the virtual environment and every tool of this
machine at the same paths; /tmp, /run and /dev/shm are its own. It has real NUMA
nodes (``--numa``), real distances (``--numa-distance``), real page migration.
Results come back through a read-write directory (``--rwdir``): the JUnit XML of
each pytest run, and the command's output on stdout.

KVM is not used: on these machines it does not boot, software emulation does
(about 20-40 s to a shell; Python runs some 50 times slower than on the host, so
the guest tests keep their processes and their memory few and small). 8 vCPUs:
16 hit a QEMU MSI-X assertion.

Needs: ``vng`` (PyPI virtme-ng, in the test extra), ``qemu-system-x86_64``
(Debian qemu-system-x86), a static ``busybox`` (busybox-static), and a kernel
image in /boot (linux-image-amd64) with its modules.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUEST_ENV = "NUMA_GUEST_TOPOLOGY"


@dataclass(frozen=True)
class Topology:
    name: str
    numa: tuple[str, ...]  # --numa MEM,cpus=A-B per node
    distances: tuple[str, ...] = ()  # --numa-distance SRC,DST=VAL
    cpus: int = 8
    memory: str = "4G"
    tests: tuple[str, ...] = ()  # the tests/numa/ files it runs


TOPOLOGIES = {
    "2node": Topology("2node", ("2G,cpus=0-3", "2G,cpus=4-7"),
                      tests=("tests/numa/test_memory_placement.py", "tests/numa/test_memory_mappings.py",
                             "tests/numa/test_isolation_host_guest.py",
                             "tests/numa/test_pool_cgroup_v2.py")),
    # the same two nodes, a boot of its own: isolation under stress-ng changes the guest's
    # host-wide masks and keeps every vCPU busy for minutes, which the memory tests must not share
    "isolation": Topology("isolation", ("2G,cpus=0-3", "2G,cpus=4-7"),
                          tests=("tests/numa/test_isolation_guest.py",)),
    # node 0's nearest neighbour is node 2 (12), not node 1 (30): "closest" and "next" differ
    "4node": Topology("4node", ("1G,cpus=0-1", "1G,cpus=2-3", "1G,cpus=4-5", "1G,cpus=6-7"),
                      ("0,1=30", "0,2=12", "0,3=40", "1,2=25", "1,3=20", "2,3=35"),
                      tests=("tests/numa/test_numa_distances.py",)),
}


def _vng() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "vng")
    return here if os.access(here, os.X_OK) else shutil.which("vng")


def kernel_image() -> str | None:
    """The newest /boot/vmlinuz-* whose modules are installed, Debian's generic flavour
    (``-amd64``) first: a cloud or other flavour may be built without 9p or NUMA."""
    images = sorted(glob.glob("/boot/vmlinuz-*"), key=os.path.getmtime, reverse=True)
    generic = [i for i in images if i.endswith("-amd64") and "-cloud-" not in i and "-rt-" not in i]
    for image in generic + [i for i in images if i not in generic]:
        release = os.path.basename(image)[len("vmlinuz-"):]
        if os.path.isdir(f"/lib/modules/{release}") and os.access(image, os.R_OK):
            return image
    return None


def why_not() -> str | None:
    """None when a guest can boot here, else what is missing (and the package that has it)."""
    missing = []
    if _vng() is None:
        missing.append("vng (PyPI virtme-ng)")
    if shutil.which("qemu-system-x86_64") is None:
        missing.append("qemu-system-x86_64 (Debian qemu-system-x86)")
    if shutil.which("busybox") is None:
        missing.append("busybox (Debian busybox-static)")
    if kernel_image() is None:
        missing.append("a kernel image with its modules in /boot (Debian linux-image-amd64)")
    return None if not missing else "cannot boot a NUMA guest: missing " + ", ".join(missing)


def vng_argv(topology: Topology, command: str, rwdir: str) -> list[str]:
    argv = [_vng() or "vng", "--disable-kvm", "--force-9p", "--run", kernel_image() or "",
            "--cpus", str(topology.cpus), "--memory", topology.memory, "--rwdir", rwdir, "--cwd", ROOT,
            # QEMU names its threads ("CPU 3/TCG"): a bench can read each vCPU's own schedstat
            "--qemu-opts=-name virtme-ng,debug-threads=on"]
    for node in topology.numa:
        argv += ["--numa", node]
    for d in topology.distances:
        argv += ["--numa-distance", d]
    return [*argv, "--exec", command]


def run_in_guest(topology: Topology, command: list[str], *, out_dir: str, timeout: float = 1200.0,
                 env: dict[str, str] | None = None,
                 on_line: Callable[[subprocess.Popen, str], None] | None = None) -> subprocess.CompletedProcess:
    """Boot ``topology`` and run ``command`` (argv) in the checkout, with ``env`` and
    ``NUMA_GUEST_TOPOLOGY=<name>`` set; ``out_dir`` is writable from the guest.
    ``on_line`` is called with the vng process and each line of the command's stdout
    as the guest prints it (a bench marking its phases for a watcher outside)."""
    exports = {GUEST_ENV: topology.name, "NUMA_GUEST_OUT": out_dir, "PYTHONDONTWRITEBYTECODE": "1",
               "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **(env or {})}
    # vng runs the command through the guest's shell: quote every word
    line = " ".join(f"{k}={_quote(v)}" for k, v in exports.items()) + " exec " + " ".join(map(_quote, command))
    vng_env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"}
    # a session of its own, so that the whole QEMU tree can be killed, and is on a timeout
    proc = subprocess.Popen(vng_argv(topology, line, out_dir), cwd=ROOT, env=vng_env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    try:
        out, err = _communicate(proc, timeout, on_line)
    except subprocess.TimeoutExpired as exc:
        _kill(proc)
        # streamed: the readers took the output (exc carries it); else communicate kept it for us
        out, err = (exc.output, exc.stderr) if on_line is not None else proc.communicate()
        err += f"\n(the guest ran past {timeout:g} s and was killed)"
    except BaseException:
        _kill(proc)  # interrupted (Ctrl-C, SIGTERM): the guest goes too, not left running
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _communicate(proc: subprocess.Popen, timeout: float,
                 on_line: Callable[[subprocess.Popen, str], None] | None) -> tuple[str, str]:
    if on_line is None:
        return proc.communicate(timeout=timeout)
    lines: list[str] = []
    err: list[str] = []

    def read_out() -> None:
        for line in proc.stdout:
            lines.append(line)
            on_line(proc, line)

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)  # its pipes close: both readers end with what the guest printed so far
        for t in readers:
            t.join()
        proc.wait()  # the pipes close before the exit is reported: reap it, so returncode is set
        raise subprocess.TimeoutExpired(proc.args, timeout, "".join(lines), "".join(err)) from None
    for t in readers:
        t.join()
    return "".join(lines), "".join(err)


_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_all() -> None:
    """Kill every guest still running (a test session that ends early leaves none behind)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        _kill(proc)
        proc.wait()


def _quote(word: str) -> str:
    import shlex

    return shlex.quote(word)


@dataclass(frozen=True)
class JunitResult:
    tests: int
    failures: int
    errors: int
    skipped: int
    failed: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.tests > 0 and not (self.failures or self.errors or self.skipped)


def read_junit(path: str) -> JunitResult:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = tuple(f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                   if c.find("failure") is not None or c.find("error") is not None or c.find("skipped") is not None)
    return JunitResult(total["tests"], total["failures"], total["errors"], total["skipped"], failed)


# vng's answer when the guest ended without its command's exit status: a kernel panic, or an
# init that died before the command ran
GUEST_DIED = 255


def pytest_in_guest(topology: Topology, *, out_dir: str, repeat: int = 1, timeout: float = 1200.0,
                    runner: Callable[..., subprocess.CompletedProcess] | None = None,
                    ) -> tuple[list[JunitResult], subprocess.CompletedProcess]:
    """Run ``topology``'s tests ``repeat`` times in one boot; one JUnit result per run.

    A guest that died before the tests began (exit 255, and no mark from ``_inside`` in
    ``out_dir``) is booted once more within ``timeout``; the output says so. Once the tests
    have begun, a death is theirs to report: never booted again. ``runner``: run_in_guest."""
    runner = runner or run_in_guest
    command = [sys.executable, "-m", "tests.numa_guest", "--inside", "--topology", topology.name,
               "--repeat", str(repeat)]
    t0 = time.monotonic()
    proc = runner(topology, command, out_dir=out_dir, timeout=timeout)
    left = timeout - (time.monotonic() - t0)
    if proc.returncode == GUEST_DIED and not os.path.exists(_started_path(out_dir, topology)) and left > 60:
        first = proc
        proc = runner(topology, command, out_dir=out_dir, timeout=left)
        proc.stderr = (f"(the first boot ended with exit {first.returncode} before the tests began; booted again. "
                       f"Its output: {(first.stdout + first.stderr)[-2000:]!r})\n{proc.stderr}")
    results = []
    for i in range(repeat):
        path = _junit_path(out_dir, topology, i)
        if os.path.exists(path):
            results.append(read_junit(path))
    return results, proc


def _junit_path(out_dir: str, topology: Topology, i: int) -> str:
    return os.path.join(out_dir, f"junit-{topology.name}-{i}.xml")


def _started_path(out_dir: str, topology: Topology) -> str:
    return os.path.join(out_dir, f"started-{topology.name}")


def _inside(topology: Topology, repeat: int) -> int:
    """In the guest: pytest over the topology's tests, ``repeat`` times, JUnit to the rwdir
    (which first gets a mark: the guest booted and the tests began)."""
    out = os.environ["NUMA_GUEST_OUT"]
    with open(_started_path(out, topology), "w"):
        pass
    rc = 0
    for i in range(repeat):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", "--junitxml",
                            _junit_path(out, topology, i), *topology.tests], cwd=ROOT)
        rc = rc or r.returncode
    return rc


class Background:
    """Every topology's tests run one after the other on a thread, while the caller does
    other work (the host's test session: the guests use CPU the host tests leave idle);
    ``result(name)`` waits for one topology's (JUnit results, the guest's output)."""

    def __init__(self, names, base_dir: str, timeout: float = 2400.0, runners=None) -> None:
        self.names, self.base_dir, self.timeout = list(names), base_dir, timeout
        # name -> callable(out_dir=, timeout=) for guests other than TOPOLOGIES' (the arm64 one)
        self.runners = dict(runners or {})
        self._done = {name: threading.Event() for name in self.names}
        self._results: dict[str, tuple[list[JunitResult], subprocess.CompletedProcess]] = {}
        self._thread = threading.Thread(target=self._run, name="numa-guests", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for name in self.names:
            out = os.path.join(self.base_dir, name)
            try:
                os.makedirs(out, exist_ok=True)
                os.chmod(out, 0o755)
                if name in self.runners:
                    self._results[name] = self.runners[name](out_dir=out, timeout=self.timeout)
                else:
                    self._results[name] = pytest_in_guest(TOPOLOGIES[name], out_dir=out, timeout=self.timeout)
            except Exception as exc:  # reported by the test that waits for it
                self._results[name] = ([], subprocess.CompletedProcess([], -1, "", f"{type(exc).__name__}: {exc}"))
            finally:
                self._done[name].set()

    def result(self, name: str, timeout: float) -> tuple[list[JunitResult], subprocess.CompletedProcess] | None:
        if not self._done[name].wait(timeout):
            return None
        return self._results[name]

    def stop(self) -> None:
        kill_all()
        self._thread.join(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", choices=[*TOPOLOGIES, "all"], default="all")
    ap.add_argument("--repeat", type=int, default=1, help="run the tests this many times in one boot")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # in the guest: run the tests
    ap.add_argument("command", nargs="*", help="a command to run instead of the tests (after --)")
    args = ap.parse_args(argv)
    if args.inside:
        return _inside(TOPOLOGIES[args.topology], args.repeat)
    # SIGTERM unwinds like Ctrl-C, so a running guest is killed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    why = why_not()
    if why:
        print(why, file=sys.stderr)
        return 1
    rc = 0
    for name in (TOPOLOGIES if args.topology == "all" else [args.topology]):
        topology = TOPOLOGIES[name]
        with tempfile.TemporaryDirectory(prefix=f"numa-guest-{name}-") as out:
            os.chmod(out, 0o755)
            if args.command:
                proc = run_in_guest(topology, args.command, out_dir=out, timeout=args.timeout)
                sys.stdout.write(proc.stdout)
                sys.stderr.write(proc.stderr)
                rc = rc or proc.returncode
                continue
            results, proc = pytest_in_guest(topology, out_dir=out, repeat=args.repeat, timeout=args.timeout)
            sys.stdout.write(proc.stdout)
            for i, r in enumerate(results):
                print(f"{name} run {i + 1}: {r.tests} tests, {r.failures} failed, {r.errors} errors, "
                      f"{r.skipped} skipped{' ' + ', '.join(r.failed) if r.failed else ''}")
            good = len(results) == args.repeat and all(r.ok for r in results)
            print(f"{name}: {sum(r.ok for r in results)} of {args.repeat} runs passed")
            rc = rc or (0 if good else 1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
