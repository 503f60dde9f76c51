"""Run tests (or any command) on a real arm64 kernel with a Kunpeng 920's NUMA layout:
Debian's arm64 kernel under ``qemu-system-aarch64 -M virt -cpu max`` (software
emulation), 8 vCPUs on 4 nodes with the distances a Kunpeng 920's ``numactl -H``
shows, and an arm64 userland (tests/arm64_image.py builds and caches it).

    python -m tests.arm64_guest                      # the arm64 tests (tests/numa/test_kunpeng920.py)
    python -m tests.arm64_guest --repeat 3
    python -m tests.arm64_guest -- python3 -m ascendbind.cli plan --npu 0
    python -m tests.arm64_guest -- --pytest 1 tests/test_applier_memory.py    # other tests, in one boot

The checkout is shared read-only over virtio-9p at its own path; a second share,
read-write, carries the request in (argv, environment) and the results out: the
JUnit XML of each pytest run, the command's exit status, files the tests leave
there (``lscpu`` outputs). The guest's console, the command's output, comes back on
stdout. Python runs some 50-100 times slower there than on the host.

Needs: ``qemu-system-aarch64`` (Debian qemu-system-arm), and for the first build
apt-get, dpkg-deb and the package registries (Debian's, PyPI).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from tests import arm64_image
from tests.numa_guest import GUEST_ENV, JunitResult, read_junit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "kunpeng920"
CPUS = 8
NODE_MEMORY_MIB = 512
# a Kunpeng 920's numactl -H (two sockets, two dies each): asymmetric, node 1's nearest
# neighbour (0, 16) is not its next node (2, 25)
DISTANCES = ((10, 16, 32, 33), (16, 10, 25, 32), (32, 25, 10, 16), (33, 32, 16, 10))
TESTS = ("tests/numa/test_kunpeng920.py",)
PYTEST = "--pytest"  # a request's argv[0] that asks inside() for pytest: [PYTEST, repeat, *tests]
QEMU = "qemu-system-aarch64"


OPT_IN = "ARM64_GUEST"


def wanted() -> bool:
    """Whether the test suite runs the arm64 guest (``ARM64_GUEST=1``; make test-arm64 always does)."""
    return os.environ.get(OPT_IN) == "1"


def why_not() -> str | None:
    """None when the guest can boot here (building its image if need be), else what is missing."""
    missing = [] if shutil.which(QEMU) else [f"{QEMU} (Debian qemu-system-arm)"]
    if arm64_image.cached() is None and arm64_image.why_not():
        missing.append(arm64_image.why_not())
    return None if not missing else "cannot boot the arm64 guest: missing " + ", ".join(missing)


def build_quietly() -> None:
    """The image, built ahead of the guest's turn; a failure shows when the guest builds it."""
    try:
        arm64_image.build(log=lambda line: None)
    except Exception:
        pass


def qemu_argv(image: str, out_dir: str) -> list[str]:
    nodes = len(DISTANCES)
    per = CPUS // nodes
    argv = [QEMU, "-M", "virt", "-cpu", "max,pauth-impdef=on", "-smp", str(CPUS),
            "-m", f"{NODE_MEMORY_MIB * nodes}M", "-nographic", "-no-reboot", "-monitor", "none",
            "-kernel", os.path.join(image, "Image"), "-initrd", os.path.join(image, "initrd.cpio"),
            "-append", "console=ttyAMA0 panic=-1 quiet loglevel=3",
            "-fsdev", f"local,id=src,path={ROOT},security_model=none,readonly=on",
            "-device", "virtio-9p-pci,fsdev=src,mount_tag=src",
            "-fsdev", f"local,id=out,path={out_dir},security_model=none",
            "-device", "virtio-9p-pci,fsdev=out,mount_tag=out"]
    for n in range(nodes):
        argv += ["-object", f"memory-backend-ram,id=m{n},size={NODE_MEMORY_MIB}M",
                 "-numa", f"node,nodeid={n},cpus={n * per}-{n * per + per - 1},memdev=m{n}"]
    for a in range(nodes):
        for b in range(a + 1, nodes):
            argv += ["-numa", f"dist,src={a},dst={b},val={DISTANCES[a][b]}"]
    return argv


def run_in_guest(command: list[str], *, out_dir: str, timeout: float = 1200.0,
                 env: dict[str, str] | None = None, log=lambda line: None) -> subprocess.CompletedProcess:
    """Boot the guest and run ``command`` (argv) in the checkout with ``env`` and
    ``NUMA_GUEST_TOPOLOGY=kunpeng920`` set; ``out_dir`` is writable from the guest and
    gets ``rc`` (the command's exit status) and ``times.json``."""
    manifest = arm64_image.build(log=log)
    # the checkout is read-only there: its bytecode is compiled here, in place (seconds, where
    # each interpreter in the guest would take tens of them), valid there as it is here
    if sys.version_info[:2] == (3, 11):  # the guest's Python: bytecode is the same on every architecture
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "ascendbind", "tests"], cwd=ROOT,
                       capture_output=True)
        if command[:1] == [PYTEST]:
            _prime_assert_rewrites(command[2:])
    guest_env = {GUEST_ENV: NAME, "NUMA_GUEST_OUT": "/out", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": ROOT,
                 "HOME": "/tmp"}
    request = {"argv": command, "env": {**guest_env, **(env or {})}}
    with open(os.path.join(out_dir, "request.json"), "w") as fh:
        json.dump(request, fh)
    with open(os.path.join(out_dir, "src"), "w") as fh:
        fh.write(ROOT)
    started = time.monotonic()
    proc = subprocess.Popen(qemu_argv(manifest["image"], out_dir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    lines: list[str] = []

    def read() -> None:  # the console as it comes (log), kept whole for the caller
        for line in proc.stdout:
            lines.append(line)
            log(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        lines.append(f"\n(the arm64 guest ran past {timeout:g} s and was killed)\n")
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
    reader.join(30)
    out = "".join(lines)
    rc_path = os.path.join(out_dir, "rc")
    rc = int(open(rc_path).read()) if os.path.exists(rc_path) else 255
    times = {"image_build_seconds": manifest["build_seconds"], "guest_seconds": round(time.monotonic() - started, 1)}
    up = [line for line in out.splitlines() if line.startswith("arm64 guest: up after")]
    if up:
        times["boot_seconds"] = float(up[0].split()[-2])
    with open(os.path.join(out_dir, "times.json"), "w") as fh:
        json.dump(times, fh)
    return subprocess.CompletedProcess(proc.args, rc, out, "")


def _prime_assert_rewrites(tests: list[str]) -> None:
    """pytest rewrites each test module's asserts and caches the result beside its bytecode;
    the guest cannot write there (the checkout is read-only, and bytecode writing is off),
    so it would rewrite every test file anew under emulation: half of collecting them,
    minutes for a few dozen files. A collection here, with the guest's pytest, writes
    those caches in place; the guest reads them, as they match the files it sees."""
    from importlib import metadata

    try:
        same = f"pytest=={metadata.version('pytest')}" in arm64_image.WHEELS
    except metadata.PackageNotFoundError:
        same = False
    if not same:  # another pytest names its caches otherwise: the guest would not read them
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env[GUEST_ENV] = NAME  # tests/numa/ is collected only where a guest topology is named
    try:
        subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *tests],
                       cwd=ROOT, env=env, capture_output=True, timeout=600)
    except subprocess.TimeoutExpired:
        pass  # the guest only rewrites them itself


_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()


def kill_all() -> None:
    """Kill every arm64 guest still running (a test session that ends early leaves none)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        proc.kill()
        proc.wait()


def pytest_in_guest(*, out_dir: str, repeat: int = 1, timeout: float = 1800.0, tests: tuple[str, ...] = TESTS,
                    log=lambda line: None) -> tuple[list[JunitResult], subprocess.CompletedProcess]:
    """The arm64 tests, ``repeat`` times in one boot; one JUnit result per run."""
    # run by inside() itself: each interpreter started costs tens of seconds there
    proc = run_in_guest([PYTEST, str(repeat), *tests], out_dir=out_dir, timeout=timeout, log=log)
    results = [read_junit(p) for p in (os.path.join(out_dir, f"junit-{NAME}-{i}.xml") for i in range(repeat))
               if os.path.exists(p)]
    return results, proc


def _uptime() -> str:
    with open("/proc/uptime") as fh:
        return fh.read().split()[0]


def inside() -> None:
    """In the guest (PID 1's child): the request the host left in /out, its status to /out/rc."""
    with open("/out/request.json") as fh:
        req = json.load(fh)
    os.environ.update(req["env"])
    os.chdir(ROOT)
    argv = req["argv"]
    print(f"arm64 guest: command starts at {_uptime()} s", flush=True)
    try:
        rc = _pytest(int(argv[1]), argv[2:]) if argv[0] == PYTEST else subprocess.run(argv).returncode
    except OSError as exc:
        print(f"arm64 guest: cannot run {argv}: {exc}", flush=True)
        rc = 127
    print(f"arm64 guest: command ended at {_uptime()} s", flush=True)
    with open("/out/rc", "w") as fh:
        fh.write(str(rc))


def _pytest(repeat: int, tests: list[str]) -> int:
    """The first run in this interpreter, any further ones each in a new one (pytest does
    not run twice in one process)."""
    import pytest

    rc = 0
    for i in range(repeat):
        args = ["-q", "-p", "no:cacheprovider", "--durations=5", "--junitxml", f"/out/junit-{NAME}-{i}.xml", *tests]
        if i == 0:
            rc = int(pytest.main(args))
        else:
            rc = rc or subprocess.run([sys.executable, "-m", "pytest", *args]).returncode
    return rc


def _print(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="run the tests this many times in one boot")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", help="keep what the guest writes (JUnit XML, lscpu outputs) in this directory")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # PID 1's command
    ap.add_argument("command", nargs="*", help="a command to run instead of the tests (after --)")
    args = ap.parse_args(argv)
    if args.inside:
        inside()
        return 0
    why = why_not()
    if why:
        print(why, file=sys.stderr)
        return 1
    try:
        arm64_image.build(log=_print)
    except arm64_image.BuildError as exc:
        print(f"cannot build the arm64 image: {exc}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="arm64-guest-") as tmp:
        out = args.out or tmp
        os.makedirs(out, exist_ok=True)
        os.chmod(out, 0o755)
        if args.command:
            proc = run_in_guest(args.command, out_dir=out, timeout=args.timeout, log=_print)
            return proc.returncode
        results, proc = pytest_in_guest(out_dir=out, repeat=args.repeat, timeout=args.timeout, log=_print)
        for i, r in enumerate(results):
            print(f"{NAME} run {i + 1}: {r.tests} tests, {r.failures} failed, {r.errors} errors, "
                  f"{r.skipped} skipped{' ' + ', '.join(r.failed) if r.failed else ''}")
        with open(os.path.join(out, "times.json")) as fh:
            print(f"{NAME}: {sum(r.ok for r in results)} of {args.repeat} runs passed; times {fh.read()}")
        return 0 if len(results) == args.repeat and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
