"""Nothing the daemon or a one-shot verb started outlives it.

Every tool runs in a process group of its own (so that a timeout can kill it
whole), which also puts it out of reach of a signal sent to the caller's group.
These tests stop a real ``ascendbind serve`` and a real ``ascendbind plan``
while the fake npu-smi of tests/hanging_tool.py hangs (it forks a grandchild
``sleep`` and waits for it), and look for any process of that run a second
after the caller exited.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.daemon_harness import ROOT, DaemonProc, base_env, free_port, wait_for
from tests.hanging_tool import HangingNpuSmi

# far longer than the test: only the shutdown can end the hung run
TIMEOUT = "120"


def _env(tmp_path, fake: HangingNpuSmi) -> dict[str, str]:
    return base_env(str(tmp_path / "ascendbind.sock"), str(tmp_path / "state"), free_port(),
                    ASCENDBIND_NPU_SMI=str(fake.path), ASCENDBIND_COMMAND_TIMEOUT_SECONDS=TIMEOUT)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_daemon_kills_and_reaps_a_hanging_tool_before_it_exits(tmp_path, sig):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    d = DaemonProc(str(tmp_path), _env(tmp_path, fake)).start()
    try:
        # the start-up discovery is now waiting for npu-smi, whose grandchild sleeps
        assert wait_for(lambda: fake.hung_runs() == 1, 30), d.log()[-2000:]
        assert fake.survivors(), "the hung run is not visible: the test could not fail"
        started = time.monotonic()
        d.proc.send_signal(sig)
        assert d.proc.wait(timeout=30) == 0, d.log()[-2000:]
        assert time.monotonic() - started < 20, "it waited for the tool instead of killing it"
        assert fake.wait_no_survivors(timeout=1.0) == [], d.log()[-2000:]
        # it stopped the tool and did not wait out the command timeout, nor start another run
        assert fake.calls() == ["info -m"], fake.calls()
        assert "ascendbind stopped" in d.log()
    finally:
        d.stop()


def test_a_one_shot_verb_killed_with_sigterm_takes_its_tool_along(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    proc = subprocess.Popen([sys.executable, "-m", "ascendbind.cli", "plan", "--npu", "0"], cwd=str(ROOT),
                            env=_env(tmp_path, fake), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: fake.hung_runs() == 1, 30)
        assert fake.survivors()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        # it still dies of SIGTERM, as a caller (a shell, a supervisor) expects
        assert proc.returncode == -signal.SIGTERM, err
        assert fake.wait_no_survivors(timeout=1.0) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
