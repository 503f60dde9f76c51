from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tests/numa/ needs a kernel with several NUMA nodes: tests/test_numa_guest.py boots one
# (tests/numa_guest.py) and runs them there, so the host collects them only in the guest
collect_ignore = [] if os.environ.get("NUMA_GUEST_TOPOLOGY") else ["numa"]

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


# directories given search permission for others so that uid 65534 can reach the checkout
# (a clone under `mktemp -d` is 0700), with the modes to put back when the session ends
_opened: dict[str, int] = {}


def _try_as_nobody() -> str | None:
    try:
        r = subprocess.run([*NOBODY, sys.executable, "-c", "import ascendbind"], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"setpriv unusable: {exc}"
    if r.returncode != 0:
        return f"uid 65534 cannot run this checkout's python: {r.stderr.strip()[-200:]}"
    return None


def _open_the_way() -> None:
    """Add search (never read) permission for others on the directories above the checkout
    and its interpreter that lack it; ``pytest_unconfigure`` takes it back."""
    for start in (ROOT, os.path.dirname(sys.executable)):
        path = os.path.abspath(start)
        while True:
            st = os.stat(path)
            if not st.st_mode & stat.S_IXOTH and path not in _opened:
                _opened[path] = stat.S_IMODE(st.st_mode)
                os.chmod(path, _opened[path] | stat.S_IXOTH)
            if path == os.path.dirname(path):
                break
            path = os.path.dirname(path)


@functools.cache
def _nobody_can_run_ascendbind() -> str | None:
    """None if uid 65534 can import ascendbind from this checkout, else why not."""
    why = _try_as_nobody()
    if why and os.geteuid() == 0 and not why.startswith("setpriv"):
        _open_the_way()
        why = _try_as_nobody()
    return why


def pytest_unconfigure(config):
    while _opened:
        path, mode = _opened.popitem()
        os.chmod(path, mode)


@pytest.fixture
def nobody_prefix():
    """argv prefix running a command as uid/gid 65534 (an unprivileged peer)."""
    why = _nobody_can_run_ascendbind()
    if why:
        pytest.skip(why)
    return NOBODY


@pytest.fixture
def daemon_survives(daemon):
    """For a module sharing one ``daemon`` (tests/daemon_harness.py) between its tests: after
    each, the daemon still answers and holds no worker, and its ``listed`` file (the pids a
    test's fake npu-smi lists, where the module keeps one) is empty again."""
    yield
    from tests.daemon_harness import survives_and_releases

    survives_and_releases(daemon)
    if getattr(daemon, "listed", None):
        with open(daemon.listed, "w"):
            pass


@pytest.fixture
def defaults_only(monkeypatch):
    """No ``ASCENDBIND_*`` variable of the environment the tests run in reaches the test: an
    operator's settings must not leak into what is compared with the defaults' answers."""
    for key in [k for k in os.environ if k.startswith("ASCENDBIND_")]:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def loop(tmp_path):
    """``make(**settings) -> (daemon, reconciler)``: real daemons and their reconcile loops,
    driven pass by pass by the test (tests/builders.py); every loop closed after it."""
    from tests.builders import daemon_loops

    with daemon_loops(tmp_path) as make:
        yield make


@pytest.fixture
def which_hierarchy(record_property):
    """Records (and prints) which cpuset cgroup hierarchy a test ran on (tests/cpuset_cgroups.py)."""
    from tests import cpuset_cgroups

    record_property("cpuset_cgroup", cpuset_cgroups.VERSION)
    print(f"\ncpuset cgroup: {cpuset_cgroups.VERSION} at {cpuset_cgroups.ROOT}")


@pytest.fixture(scope="session", autouse=True)
def _logs_to_the_real_stderr():
    """The background threads of in-process daemons (locality rounds, memory moves) log
    when they finish; structlog's default prints to whatever ``sys.stdout`` is at that
    moment, which may be another test's redirect (golden.run_plan reads the CLI's JSON
    from it). Their lines go to the process's own stderr instead."""
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.__stderr__))
    yield
    structlog.reset_defaults()


# Machines here are shared and noisy: a property test must fail on a wrong answer,
# never on a slow example.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ascendbind", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ascendbind")


def pytest_addoption(parser):
    parser.addoption("--shuffle", metavar="SEED", default=None,
                     help="run the collected tests in an order shuffled with SEED (finds tests that "
                          "depend on the tests before them)")
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the soak-marked tests at their large counts (tests/soak.py; make soak)")


def pytest_configure(config):
    if config.getoption("--soak"):
        from tests import soak

        os.environ[soak.ENV] = "1"


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle")
    if seed is not None:
        import random

        random.Random(seed).shuffle(items)
    # the NUMA guests boot, and the Debian roots run their host-independent files, in the
    # background once collection ends (pytest_collection_finish); the tests that read those
    # runs wait for them at the end of the session, after everything else (the guests last)
    later = [item for item in items if _roots_background_item(item)]
    guests = [item for item in items if item.nodeid.startswith(NUMA_GUEST_TESTS)]
    if later or guests:
        items[:] = [item for item in items if item not in later and item not in guests] + later + guests


NUMA_GUEST_TESTS = "tests/test_numa_guest.py"
ARM64_GUEST_TEST = "test_the_arm64_tests_pass"
ROOTS_BACKGROUND_TEST = "tests/test_debian_roots.py::test_the_host_independent_tests_pass"
_numa_guests = None  # tests/numa_guest.py's Background run, while the session has one
_roots_background = None  # tests/debian_roots.py's Background run, while the session has one


def _roots_background_item(item) -> bool:
    return item.nodeid.startswith(ROOTS_BACKGROUND_TEST + "[")


def _start_roots_background(session) -> None:
    """The Debian roots' host-independent runs, started now beside the suite (their test
    waits for them at the end): pure computation, while the host's tests mostly wait."""
    global _roots_background
    suites = sorted({item.callspec.params["root"] for item in session.items
                     if _roots_background_item(item) and hasattr(item, "callspec")})
    if not suites:
        return
    from tests import debian_roots

    ready = debian_roots.Background.wanted(suites)
    if ready:
        _roots_background = debian_roots.Background(ready)


def pytest_collection_finish(session):
    """Start the NUMA guests now, in the background: a guest is software emulation, mostly
    CPU, while the host's tests mostly wait on real processes and the kernel."""
    global _numa_guests
    if session.config.option.collectonly:
        return
    _start_roots_background(session)
    from tests import arm64_guest, numa_guest

    guests = [item for item in session.items if item.nodeid.startswith(NUMA_GUEST_TESTS)]
    names = []
    if numa_guest.why_not() is None:  # else the tests say why (and fail in CI)
        names = sorted({item.callspec.params["name"] for item in guests if hasattr(item, "callspec")})
    runners = {}
    # the arm64 guest after the x86 ones, on the same thread: guests are CPU-bound emulation
    if (any(item.name.startswith(ARM64_GUEST_TEST) for item in guests) and arm64_guest.wanted()
            and arm64_guest.why_not() is None):
        names.append(arm64_guest.NAME)
        runners[arm64_guest.NAME] = arm64_guest.pytest_in_guest
        # its image (downloads, mostly waiting on the network) is built meanwhile, not in turn
        import threading

        threading.Thread(target=arm64_guest.build_quietly, name="arm64-image", daemon=True).start()
    if not names:
        return
    import tempfile

    base = tempfile.mkdtemp(prefix="numa-guests-")
    _numa_guests = numa_guest.Background(names, base, runners=runners)


def pytest_sessionfinish(session, exitstatus):
    if _roots_background is not None:
        _roots_background.stop()
    if _numa_guests is not None:
        import shutil

        from tests import arm64_guest

        arm64_guest.kill_all()
        _numa_guests.stop()
        shutil.rmtree(_numa_guests.base_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def numa_guests():
    """The session's background guest run (None when this session started none)."""
    return _numa_guests


@pytest.fixture(scope="session")
def roots_background():
    """The session's background run of the Debian roots (None when this session started none)."""
    return _roots_background
