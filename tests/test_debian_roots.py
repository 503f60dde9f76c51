"""The package on the oldest and the newest Python it supports, run for real in Debian roots.

Debian 11 (Python 3.9, systemd 247, pip 20.3, the dependencies at pyproject.toml's lower
bounds) and Debian 13 (Python 3.13, the dependencies' newest): the suite's host-independent
files pass on each root's own ``python3``, a daemon started there binds real workers on this
kernel, and a wheel built here installs with Debian 11's own pip and plans the A3 host as the
host's Python does. tests/debian_roots.py builds and caches the roots; a machine without
``mmdebstrap`` skips here and fails in CI.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import debian_roots
from tests.deploy_tools import missing

ROOT = Path(__file__).resolve().parent.parent
PYTHON = {"bullseye": "3.9", "trixie": "3.13"}
SUITES = sorted(debian_roots.RECIPES)
A3 = ["plan", "--snapshot", "fixtures/hosts/a3-16die", "--npu", "5"]


@pytest.fixture(scope="module", params=SUITES)
def root(request) -> tuple[str, Path]:
    if shutil.which("mmdebstrap") is None:
        missing("mmdebstrap")
    return request.param, debian_roots.prepare(request.param)


def _pytest_in(root: Path, *args: str) -> subprocess.CompletedProcess:
    return debian_roots.run_in(root, debian_roots.pytest_argv(*args))


def _summary(r: subprocess.CompletedProcess) -> str:
    return (r.stdout.strip().splitlines() or [""])[-1]


def test_the_root_runs_its_own_python_with_the_dependencies_pinned(root):
    suite, path = root
    r = debian_roots.run_in(path, ["python3", "-m", "pip", "freeze", "--disable-pip-version-check"])
    v = debian_roots.run_in(path, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
    assert v.stdout.strip() == PYTHON[suite], v.stdout + v.stderr
    frozen = {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
              for line in r.stdout.splitlines() if "==" in line}
    for pin in debian_roots.RECIPES[suite].pins():
        name, _, version = pin.partition("==")
        assert name in frozen, (name, r.stdout)
        if version:  # the lower bound, exactly (5.9 is 5.9.0)
            assert frozen[name].rstrip(".0") == version.rstrip(".0") or frozen[name] == version, (pin, frozen[name])


def test_the_host_independent_tests_pass(root, record_property, roots_background):
    suite, path = root
    # run beside the suite since collection ended, where the session could (tests/conftest.py)
    if roots_background is not None and suite in roots_background.suites:
        r = roots_background.result(suite)
    else:
        r = _pytest_in(path, *debian_roots.HOST_INDEPENDENT)
    record_property(f"{suite}_summary", _summary(r))
    print(f"\n{suite}: {_summary(r)}")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    # nothing skipped, nothing failed (past a minute pytest adds the time as h:mm:ss)
    assert re.fullmatch(r"\d+ passed in [\d.]+s( \(\d+:\d\d:\d\d\))?", _summary(r)), _summary(r)


def test_a_daemon_in_the_root_binds_real_workers(root):
    _suite, path = root
    r = _pytest_in(path, *debian_roots.DAEMON_TESTS)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert re.match(r"5 passed", _summary(r)), _summary(r)


def test_the_workers_side_imports_with_the_standard_library_alone(root):
    # the client and the vLLM plugin load in the serving stack's Python, which need not
    # have the daemon's dependencies: -S leaves site-packages out, the checkout is the cwd
    _suite, path = root
    probe = ("import sys, ascendbind.client, ascendbind.integrations; "
             "print(sorted(m for m in sys.modules if not m.startswith(('ascendbind', '_')) and "
             "getattr(sys.modules[m], '__file__', None) and 'packages' in sys.modules[m].__file__))")
    r = debian_roots.run_in(path, ["python3", "-S", "-c", probe])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout


@pytest.fixture(scope="module")
def wheel_tree(tmp_path_factory) -> tuple[Path, str]:
    """A copy of the checkout with a wheel built from it under dist/ (the wheel's name)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    junk = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache")
    shutil.copytree(ROOT, src, ignore=junk, symlinks=True)
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(src / "dist"),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = (src / "dist").glob("ascendbind-*.whl")
    return src, whl.name


def test_a_wheel_built_here_installs_with_debian_11s_pip_and_plans_the_a3_host(wheel_tree):
    if shutil.which("mmdebstrap") is None:
        missing("mmdebstrap")
    src, whl = wheel_tree
    path = debian_roots.prepare("bullseye")
    here = subprocess.run([sys.executable, "-m", "ascendbind", *A3], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert here.returncode == 0, here.stderr
    # Debian's pip 20.3 from /usr/lib/python3 into /usr/local; --no-index: the dependencies
    # already there (the lower bounds) must satisfy the wheel's metadata. From / (not the
    # checkout), so the installed package is what runs; the overlay drops the install afterwards.
    script = ("python3 -m pip --version && python3 -m pip install --no-index --disable-pip-version-check "
              f"/src/dist/{whl} && python3 -c 'import ascendbind; print(ascendbind.__file__)' && "
              "cd /src && exec ascendbind " + " ".join(A3))
    r = debian_roots.run_in(path, ["/bin/sh", "-c", script], cwd="/", binds_src=src)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    pip_line, *rest = r.stdout.splitlines()
    assert re.match(r"pip 20\.3\.\d+ from /usr/lib/python3/dist-packages/pip \(python 3\.9\)", pip_line), pip_line
    where = next(line for line in rest if line.endswith("__init__.py"))
    assert where.startswith("/usr/local/lib/python3.9/dist-packages/ascendbind/"), where
    plan = "\n".join(rest[rest.index(where) + 1:]) + "\n"
    assert plan == here.stdout, (plan, here.stdout)
    assert "device: A3" in plan and re.search(r"^5 +200-239 ", plan, re.M), plan
