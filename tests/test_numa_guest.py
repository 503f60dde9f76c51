"""The memory and isolation tests on real multi-NUMA kernels, from the host's suite.

This machine has one NUMA node, where the memory step has nothing to do, and its own
host-wide masks are not the suite's to change. Each test here boots a QEMU guest of
this machine's kernel with several nodes (tests/numa_guest.py) and runs its share of
tests/numa/ in it (the isolation guest: isolation under stress-ng); it passes when
every test there passed, none skipped. Where a guest cannot boot it is skipped here, and fails in
CI (``CI`` set): CI installs what the guest needs (.ci/run).

The arm64 guest (tests/arm64_guest.py) is the target architecture: Debian's arm64
kernel with a Kunpeng 920's four nodes, running tests/numa/test_kunpeng920.py. It
joins the suite with ARM64_GUEST=1 (several minutes of emulation more; CI's .ci/run
sets it unless told ARM64_GUEST=0); there, a guest that cannot boot fails in CI like
the others."""

from __future__ import annotations

import os

import pytest

from tests import arm64_guest
from tests.numa_guest import ROOT, TOPOLOGIES, pytest_in_guest, why_not


def defined_tests(files) -> int:
    """How many test functions ``files`` define (parametrized ones count once)."""
    import ast

    count = 0
    for rel in files:
        with open(os.path.join(ROOT, rel)) as fh:
            tree = ast.parse(fh.read())
        count += sum(1 for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"))
    return count


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_the_numa_tests_pass_on_their_guest(name, tmp_path, numa_guests):
    why = why_not()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    if numa_guests is not None:  # booted when the session's collection ended (tests/conftest.py)
        got = numa_guests.result(name, timeout=2700)
        assert got is not None, f"the {name} guest did not finish in time"
        results, proc = got
    else:
        out = tmp_path / "out"
        out.mkdir()
        os.chmod(out, 0o755)
        results, proc = pytest_in_guest(TOPOLOGIES[name], out_dir=str(out), timeout=2400)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert len(results) == 1, f"the guest wrote no test results (exit {proc.returncode}):\n{log}"
    (r,) = results
    assert r.ok and proc.returncode == 0, f"{r}\n{log}"
    assert r.tests >= defined_tests(TOPOLOGIES[name].tests), r  # every test the files define ran


def test_the_arm64_tests_pass_on_a_kunpeng_920_guest(tmp_path, numa_guests):
    if not arm64_guest.wanted():
        pytest.skip(f"the arm64 guest runs in the suite with {arm64_guest.OPT_IN}=1 (alone: make test-arm64)")
    why = arm64_guest.why_not()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    if numa_guests is not None and arm64_guest.NAME in numa_guests.names:
        got = numa_guests.result(arm64_guest.NAME, timeout=2700)
        assert got is not None, "the arm64 guest did not finish in time"
        results, proc = got
    else:
        out = tmp_path / "out"
        out.mkdir()
        os.chmod(out, 0o755)
        results, proc = arm64_guest.pytest_in_guest(out_dir=str(out), timeout=2400)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert len(results) == 1, f"the arm64 guest wrote no test results (exit {proc.returncode}):\n{log}"
    (r,) = results
    assert r.ok and proc.returncode == 0, f"{r}\n{log}"
    assert r.tests >= 4
