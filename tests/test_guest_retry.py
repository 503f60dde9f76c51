"""The guest harness boots again a guest that died before its tests began (vng's exit 255:
a panic or an init that died, with no exit status of the command), and only that one:
checked with a stand-in for the boot, since a boot that dies cannot be had on demand."""

from __future__ import annotations

import subprocess

import pytest

from tests import numa_guest
from tests.numa_guest import TOPOLOGIES, pytest_in_guest


_JUNIT = '<testsuite tests="1" failures="0" errors="0" skipped="0"><testcase classname="t" name="a"/></testsuite>'


def _stand_in(answers):
    """A runner in run_in_guest's place that plays ``answers`` in turn: (exit status, whether the
    tests began: the mark and a JUnit file written to out_dir, as ``_inside`` writes them)."""
    calls = []

    def run(topology, command, *, out_dir, timeout):
        rc, began = answers[len(calls)]
        calls.append(timeout)
        if began:
            with open(numa_guest._started_path(out_dir, topology), "w"):
                pass
            with open(numa_guest._junit_path(out_dir, topology, 0), "w") as fh:
                fh.write(_JUNIT)
        return subprocess.CompletedProcess(command, rc, "", f"run {len(calls)}\n")

    return run, calls


def test_a_guest_that_died_before_its_tests_is_booted_once_more_and_says_so(tmp_path):
    run, calls = _stand_in([(numa_guest.GUEST_DIED, False), (0, True)])
    results, proc = pytest_in_guest(TOPOLOGIES["4node"], out_dir=str(tmp_path), timeout=600, runner=run)
    assert len(calls) == 2 and calls[1] <= 600
    assert [r.ok for r in results] == [True] and proc.returncode == 0
    assert "exit 255 before the tests began; booted again" in proc.stderr and "run 1" in proc.stderr


@pytest.mark.parametrize("answers", [
    [(numa_guest.GUEST_DIED, True)],  # died once the tests had begun: theirs to report
    [(1, False)],  # any other failure
    [(numa_guest.GUEST_DIED, False), (numa_guest.GUEST_DIED, False)],  # twice: once more, never a loop
])
def test_a_guest_is_booted_again_only_when_it_died_before_its_tests(tmp_path, answers):
    run, calls = _stand_in(answers)
    _results, proc = pytest_in_guest(TOPOLOGIES["4node"], out_dir=str(tmp_path), timeout=600, runner=run)
    assert len(calls) == min(len(answers), 2) and proc.returncode == answers[-1][0]
