"""Debian roots at both ends of the Python range the package supports, for running it for real.

    python -m tests.debian_roots --prepare            # build (or find) every root, print their paths
    python -m tests.debian_roots --run bullseye -- python3 -m pytest -q tests/test_cpulist.py

The hosts ascendbind serves run their distribution's own Python and systemd: Python 3.9
and systemd 249 on openEuler 22.03, 3.13 on the newest Debian. A linter reads the source
for new constructs; only a real interpreter shows what changed in behaviour. So:

* ``bullseye`` (Debian 11): Python 3.9.2, glibc 2.31, systemd 247, pip 20.3. The
  package's dependencies at the *lowest* versions ``pyproject.toml`` admits on 3.9 (each
  ``>=X`` read from the file and installed as ``==X``), so a lower bound there is a
  version that was run, not a guess.
* ``trixie`` (Debian 13): Python 3.13, with the dependencies' current releases.

Each root is made once by ``mmdebstrap`` from the Debian archive and kept under
``~/.cache/ascendbind-roots/<suite>-<recipe hash>/``; a change to the recipe (packages,
pins) names a new directory, and the old one is left for ``rm -r``. A build happens in a
sibling directory and is renamed into place only when complete, under a lock, so an
interrupted or concurrent build never leaves a half root that looks finished.

``in_root`` runs a command in a root: a private mount namespace (``unshare -m``, nothing
leaks to the host's mount table), an overlay over the cached root so that whatever the
command writes (an installed wheel, pytest's files) is gone afterwards, ``/proc``,
``/sys`` and ``/dev`` of this machine's kernel, the checkout at ``/src``, then
``chroot`` and the root's own ``python3``. Processes keep this machine's PID namespace:
a daemon in the root binds a worker in the root on this kernel, as on a host.

``HOST_INDEPENDENT`` is the one list of the suite's files that need nothing of the host
but a kernel: the pure core (parsers, planner, values, golden plans), the CLI's ``plan``
on snapshots, configuration, the client's wire format, the eventfd.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ascendbind-roots"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
# the trust store the host's pip uses (a proxy's CA included, where there is one): copied into
# a root only while its pip downloads, then removed
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
BUILD_TIMEOUT = 900

# python3 + pip: the suite; systemd, systemd-sysv, dbus: booted as PID 1 by systemd-nspawn
# (tests/systemd_harness.py); procps (ps), curl: the daemon's tools and the daemon tests' client;
# make: `make install-service` writes the units there as on a host
APT = ("python3", "python3-pip", "systemd", "systemd-sysv", "dbus", "procps", "curl", "make")

# the suite's files that need nothing of the host but its kernel (run by every root)
HOST_INDEPENDENT = (
    "tests/test_cli_plan.py", "tests/test_client_wire.py", "tests/test_config.py", "tests/test_cpulist.py",
    "tests/test_daemon_wire.py", "tests/test_discovery_columns.py", "tests/test_discovery_parsers.py",
    "tests/test_discovery_snapshot.py", "tests/test_eventfd.py", "tests/test_golden_plans.py",
    "tests/test_golden_variants.py", "tests/test_isolation_rules.py", "tests/test_kubelet_cgroup_names.py",
    "tests/test_lifecycle_rules.py", "tests/test_plan_irqs.py", "tests/test_planner_alignment.py",
    "tests/test_planner_errors.py", "tests/test_planner_explain.py", "tests/test_planner_merge.py",
    "tests/test_planner_policy.py", "tests/test_planner_properties.py", "tests/test_planner_roles.py",
    "tests/test_planner_seed.py", "tests/test_planner_smt.py", "tests/test_product_text.py",
    "tests/test_settings.py", "tests/test_state_record.py", "tests/test_targets_rule.py",
    "tests/test_thread_classes.py",
)
# a real daemon (tests/daemon_harness.py) binding real workers, read back from /proc, and
# new daemons answering their first requests at once (Python 3.9's concurrent imports)
DAEMON_TESTS = ("tests/test_daemon_api.py", "tests/test_first_requests.py", "-k",
                "bind_through_curl or release_restores or drifted_mask or late_acl or first_requests")
# what the suite itself needs on top of the package's dependencies (the test extra's first two)
TEST_NEEDS = ("pytest", "hypothesis")


@dataclass(frozen=True)
class Recipe:
    suite: str
    python: str  # the suite's python3, for the dependencies' markers
    oldest: bool  # the dependencies at pyproject.toml's lower bounds (else their newest)
    apt: tuple[str, ...] = APT
    pip_flags: tuple[str, ...] = field(default=())

    def pins(self) -> tuple[str, ...]:
        return pip_requirements(self.python, self.oldest)

    def key(self) -> str:
        text = json.dumps([self.suite, self.apt, self.pip_flags, self.pins(), MIRROR])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


RECIPES = {
    "bullseye": Recipe("bullseye", "3.9", oldest=True),
    # PEP 668: Debian 12 on marks the system Python as the distribution's; a test root may mix
    "trixie": Recipe("trixie", "3.13", oldest=False, pip_flags=("--break-system-packages",)),
}


def pip_requirements(python: str, oldest: bool) -> tuple[str, ...]:
    """The package's dependencies and the suite's needs as pip arguments for ``python``:
    ``name==<lower bound>`` when ``oldest``, else the bare name (the newest release)."""
    with open(ROOT / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    wanted = [*project["dependencies"],
              *(d for d in project["optional-dependencies"]["test"] if Requirement(d).name in TEST_NEEDS)]
    out = []
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"python_version": python}):
            continue
        if not oldest:
            out.append(req.name)
            continue
        lows = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lows) == 1, f"{text}: a dependency needs one lower bound (>=) to be tested at"
        out.append(f"{req.name}=={lows[0]}")
    return tuple(out)


def root_path(suite: str) -> Path:
    recipe = RECIPES[suite]
    return CACHE / f"{suite}-{recipe.key()}"


def _ready(path: Path) -> bool:
    return (path / ".ascendbind-root").is_file()


def prepare(suite: str, log=sys.stderr) -> Path:
    """The root for ``suite``, built first if the cache lacks it; RuntimeError with the tool's words."""
    path = root_path(suite)
    if _ready(path):
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{suite}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(path):  # built by another process while this one waited
            return path
        building = path.with_name(path.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        try:
            _build(RECIPES[suite], building, log)
            building.rename(path)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return path


def _build(recipe: Recipe, target: Path, log) -> None:
    print(f"debian_roots: building {recipe.suite} at {target}", file=log, flush=True)
    _check([shutil.which("mmdebstrap") or "mmdebstrap", "--variant=minbase", "--quiet",
            "--aptopt=Acquire::Retries \"3\"", f"--include={','.join(recipe.apt)}", recipe.suite, str(target),
            MIRROR], "mmdebstrap")
    shutil.copyfile("/etc/resolv.conf", target / "etc" / "resolv.conf")
    cert = []
    if os.path.exists(HOST_CA):
        shutil.copyfile(HOST_CA, target / "tmp" / "host-ca.crt")
        cert = ["--cert", "/tmp/host-ca.crt"]
    pip = ["python3", "-m", "pip", "install", "--quiet", "--no-warn-script-location", "--retries", "5", *cert,
           "--disable-pip-version-check", *recipe.pip_flags, *recipe.pins()]
    _check(_in_root_argv(target, pip, overlay=False, binds=()), f"pip in the {recipe.suite} root")
    (target / "tmp" / "host-ca.crt").unlink(missing_ok=True)
    versions = run_in(target, ["python3", "-c", "import platform; print(platform.python_version())"], overlay=False)
    (target / ".ascendbind-root").write_text(json.dumps({"suite": recipe.suite, "pins": recipe.pins(),
                                                         "python": versions.stdout.strip()}) + "\n")


def _check(argv: list[str], what: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed ({r.returncode}): {(r.stderr or r.stdout)[-3000:]}")


# The mounts, in a private mount namespace: the root (read-write, or an overlay whose upper
# layer is a scratch directory), this kernel's /proc, /sys, /dev, then each (source, target)
# pair up to "--" bound into the root. Arguments are positional parameters, never spliced
# into the script.
_MOUNTS = r'''
set -e
root=$1 scratch=$2; shift 2
if [ -n "$scratch" ]; then
    mkdir -p "$scratch/upper" "$scratch/work" "$scratch/merged"
    mount -t overlay overlay -o "lowerdir=$root,upperdir=$scratch/upper,workdir=$scratch/work" "$scratch/merged"
    root=$scratch/merged
fi
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
while [ "$1" != -- ]; do
    mkdir -p "$root$2"
    mount --bind "$1" "$root$2"
    shift 2
done
shift
exec chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 ${CI:+CI=$CI} "$@"
'''


def _in_root_argv(root: Path, argv: list[str], *, overlay: bool, scratch: str = "",
                  binds: tuple[tuple[Path, str], ...] = ((ROOT, "/src"),)) -> list[str]:
    pairs = [str(x) for src, dst in binds for x in (src, dst)]
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _MOUNTS, "sh",
            str(root), scratch if overlay else "", *pairs, "--", *argv]


def run_in(root: Path, argv: list[str], *, overlay: bool = True, cwd: str = "/src", timeout: float | None = 600,
           binds_src: Path = ROOT, binds: tuple[tuple[Path, str], ...] = (), nice: int = 0,
           started=None) -> subprocess.CompletedProcess:
    """Run ``argv`` in ``root`` from ``cwd`` (see the module's docstring), ``binds_src`` at
    /src and each (directory, path) of ``binds`` at its path; the completed process.
    ``nice``: run it (and all it starts) that much nicer, in a process group of its own,
    handed to ``started`` as soon as it runs (``Background`` renices and kills it)."""
    with tempfile.TemporaryDirectory(prefix="ascendbind-root-") as scratch:
        inner = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv]
        full = _in_root_argv(root, inner, overlay=overlay, scratch=scratch, binds=((binds_src, "/src"), *binds))
        if nice:
            full = ["nice", "-n", str(nice), *full]
        with subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=bool(nice)) as proc:
            if started is not None:
                started(proc)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        return subprocess.CompletedProcess(full, proc.returncode, out, err)


def pytest_argv(*args: str) -> list[str]:
    """The root's own pytest over ``args``, as the suite runs it there."""
    return ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args]


class Background:
    """The host-independent files run in each root while the rest of the suite runs.

    They are pure computation (planner, parsers, goldens: about a minute of one CPU per
    root), while the host's tests mostly wait on real processes, daemons, systemd and the
    kernel. Run at the lowest priority (nice 19, the whole process group), they take only
    the CPU time the suite leaves idle; the test that needs a result raises them back to
    the normal priority before it waits, so a run the suite starved still ends promptly.
    One root after the other, in a thread of the session."""

    NICE = 19

    def __init__(self, suites: list[str]) -> None:
        import threading

        self.suites = list(suites)
        self._done = {suite: threading.Event() for suite in self.suites}
        self._results: dict[str, subprocess.CompletedProcess | BaseException] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._stopped = False
        threading.Thread(target=self._run_all, name="debian-roots", daemon=True).start()

    @staticmethod
    def wanted(suites) -> list[str]:
        """The suites a background run can start for now: mmdebstrap present (else the tests
        say why) and the root already built (a build is the test's, in turn)."""
        if shutil.which("mmdebstrap") is None:
            return []
        return [suite for suite in suites if _ready(root_path(suite))]

    def _run_all(self) -> None:
        for suite in self.suites:
            try:
                if self._stopped:
                    raise RuntimeError("the session ended before this root's run started")
                self._results[suite] = run_in(
                    root_path(suite), pytest_argv(*HOST_INDEPENDENT), timeout=None, nice=self.NICE,
                    started=lambda proc, suite=suite: self._procs.__setitem__(suite, proc))
            except BaseException as exc:  # the test that asks reports it
                self._results[suite] = exc
            finally:
                self._done[suite].set()

    def result(self, suite: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """``suite``'s completed run, waiting for it (at the normal priority) up to ``timeout`` s."""
        for proc in self._procs.values():
            with contextlib.suppress(OSError):  # PermissionError: only root may lower a nice value
                os.setpriority(os.PRIO_PGRP, proc.pid, 0)
        self.NICE = 0  # a root not started yet starts at the normal priority
        if not self._done[suite].wait(timeout):
            raise TimeoutError(f"the {suite} root's host-independent run took over {timeout:g} s past the suite")
        out = self._results[suite]
        if isinstance(out, BaseException):
            raise out
        return out

    def stop(self) -> None:
        """Kill what still runs (the session is over)."""
        self._stopped = True
        for proc in self._procs.values():
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, 9)


def _source_key() -> str:
    h = hashlib.sha256()
    files = [ROOT / "pyproject.toml", ROOT / "MANIFEST.in"]
    files += sorted(p for p in (ROOT / "ascendbind").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def opt_venv(suite: str) -> Path:
    """This checkout installed in ``suite``'s root as docs/operations.md says for a venv:
    ``/opt/ascendbind``, the root's own python3, the dependencies it already has (the
    pinned ones) seen through ``--system-site-packages``, the checkout's wheel installed
    by the root's pip. Kept next to the root, one per source version."""
    root = prepare(suite)
    venv = root.with_name(f"{root.name}-opt-{_source_key()}")
    if (venv / ".ready").is_file():
        return venv
    with open(CACHE / f".{suite}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".ready").is_file():  # else made by another process while this one waited
            _make_opt_venv(suite, root, venv)
    return venv


def _make_opt_venv(suite: str, root: Path, venv: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    venv.mkdir()
    with tempfile.TemporaryDirectory(prefix="ascendbind-wheel-") as wheels:
        _check([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir",
                wheels, str(ROOT)], "pip wheel")
        (whl,) = Path(wheels).glob("ascendbind-*.whl")
        script = ("python3 -m venv --without-pip --system-site-packages /opt/ascendbind && "
                  "/opt/ascendbind/bin/python -m pip install -q --no-index --no-deps --disable-pip-version-check "
                  f"/wheels/{whl.name}")
        r = run_in(root, ["/bin/sh", "-c", script], binds=((venv, "/opt/ascendbind"), (Path(wheels), "/wheels")))
    if r.returncode != 0:
        raise RuntimeError(f"the /opt/ascendbind venv in {suite}: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    (venv / ".ready").write_text("")


@contextlib.contextmanager
def _timed(what: str, log):
    import time

    t0 = time.monotonic()
    yield
    print(f"debian_roots: {what} in {time.monotonic() - t0:.1f} s", file=log, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.debian_roots", description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", action="store_true", help="build (or find) the roots and print their paths")
    ap.add_argument("--suite", action="append", choices=sorted(RECIPES), help="only these (default: all)")
    ap.add_argument("--run", metavar="SUITE", choices=sorted(RECIPES), help="run a command in SUITE's root")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command for --run (after --)")
    args = ap.parse_args(argv)
    if args.run:
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        r = run_in(prepare(args.run), command or ["python3", "--version"])
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        return r.returncode
    if not args.prepare:
        ap.error("--prepare or --run SUITE")
    # side by side: a build waits on the archive and on dpkg more than on a CPU
    suites = args.suite or sorted(RECIPES)
    with _timed(f"{', '.join(suites)} ready", sys.stderr), ThreadPoolExecutor(len(suites)) as pool:
        for path in pool.map(prepare, suites):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
