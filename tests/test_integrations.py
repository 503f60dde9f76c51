"""The vLLM hook-up: a stand-in vLLM process finds ascendbind's entry point the way
vLLM's plugin loader does, and a real daemon binds it once it drives an NPU.

vLLM is not installed here; tests/vllm_standin.py plays its processes (it loads
the plugin through importlib.metadata and, on `drive N`, creates the world group a
vLLM worker creates once it has set its device). The daemon is real, with the
fixture npu-smi describing one NPU, or two (ASCENDBIND_FAKE_NPUS=2) for tensor
parallelism; threads are read back from /proc.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from ascendbind.integrations import ascend_env, bind_current_process, vllm_local_rank

from .daemon_harness import metric_value, running_daemon, wait_for
from .workers import cpus_allowed_of

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "vllm_standin.py"


class StandIn:
    def __init__(self, directory: Path, name: str, **env: str) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("ASCENDBIND_", "VLLM_", "ASCEND_RT_"))}
        base.pop("PYTHONPATH", None)  # ascendbind must come from the installed entry point
        base.update(env)
        self.stderr_path = directory / f"{name}.stderr"
        self._stderr = open(self.stderr_path, "w")
        # own session: closing kills the whole group, forked children included
        self.proc = subprocess.Popen([sys.executable, str(STANDIN)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env=base, cwd=str(ROOT), text=True,
                                     start_new_session=True)
        self.pid = self.proc.pid
        ready = self.proc.stdout.readline().strip()
        assert ready == "ready", f"stand-in did not start: {ready!r}\n{self.stderr()}"

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        assert reply and reply != "?", f"stand-in did not answer {line!r}\n{self.stderr()}"
        return reply

    def quit(self) -> int:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        return self.proc.wait(timeout=60)

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for fh in (self.proc.stdin, self.proc.stdout, self._stderr):
            fh.close()


@contextlib.contextmanager
def standin(directory: Path, name: str, **env: str):
    s = StandIn(directory, name, **env)
    try:
        yield s
    finally:
        s.close()


def held(d) -> dict[int, dict]:
    return {w["pid"]: w for w in d.client.workers()["workers"]}


def assert_threads_follow_plan(pid: int, entry: dict) -> None:
    """Every live thread of pid is confined to its role's CPUs in the daemon's plan."""
    (npu_plan,) = entry["plan"]["npus"].values()
    threads = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        role = "acl" if comm.startswith("acl_thread") else "release" if comm.startswith("release_thread") else "main"
        allowed = cpus_allowed_of(pid, int(tid))
        if allowed is None:
            continue
        assert allowed == frozenset(npu_plan[role]), (comm, sorted(allowed), npu_plan)
        threads += 1
    assert threads >= 4  # main, acl_thread, release_thread, worker_0


# ------------------------------------------------------------------ registration


def test_the_vllm_entry_point_is_declared_and_installed():
    with open(ROOT / "pyproject.toml", "rb") as fh:
        declared = tomllib.load(fh)["project"]["entry-points"]["vllm.general_plugins"]
    assert declared == {"ascendbind": "ascendbind.integrations:vllm_plugin"}
    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "ascendbind"]
    assert len(found) == 1, "entry point not installed: rerun `make install`"
    assert found[0].value == declared["ascendbind"] and found[0].dist.name == "ascendbind"
    from ascendbind import integrations

    assert found[0].load() is integrations.vllm_plugin


def test_importing_the_integration_pulls_in_only_the_standard_library():
    code = ("import sys, ascendbind.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('structlog', 'prometheus_client', 'tenacity', 'pyudev', 'psutil')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------ pure rules


def test_the_plugin_sends_exactly_the_ascend_variables_the_daemon_weighs():
    # the index is local to what the worker sees; the daemon resolves it (test_targets_rule.py)
    env = {"ASCEND_VISIBLE_DEVICES": "5", "ASCEND_RT_VISIBLE_DEVICES": "0", "ASCEND_RUNTIME_OPTIONS": "",
           "ASCEND_HOME_PATH": "/usr/local/Ascend", "HF_TOKEN": "secret"}
    assert ascend_env(env) == {"ASCEND_VISIBLE_DEVICES": "5", "ASCEND_RT_VISIBLE_DEVICES": "0",
                               "ASCEND_RUNTIME_OPTIONS": ""}
    assert ascend_env({}) == {}


def test_local_rank_is_read_only_from_an_initialised_world_group():
    class World:
        def __init__(self, rank):
            self.local_rank = rank

    class State:
        def __init__(self, world):
            self._WORLD = world

    key = "vllm.distributed.parallel_state"
    assert vllm_local_rank({}) is None                          # not a vLLM process
    assert vllm_local_rank({key: State(None)}) is None          # vLLM, no device yet
    assert vllm_local_rank({key: State(World(2))}) == 2
    assert vllm_local_rank({key: State(World(True))}) is None
    assert vllm_local_rank({key: State(World("1"))}) is None


# ------------------------------------------------------------------ against a real daemon


def test_a_worker_is_bound_to_its_npu_once_it_drives_it(tmp_path):
    with running_daemon(str(tmp_path)) as d, \
            standin(tmp_path, "worker", ASCENDBIND_SOCKET=d.sock) as w:
        assert w.ask("watchers") == "1"       # the plugin was called twice, one watcher
        w.ask("drive 0")
        assert w.ask("join") == "done"
        assert wait_for(lambda: w.pid in held(d), 30), d.log()
        entry = held(d)[w.pid]
        assert entry["npus"] == [0]
        assert_threads_follow_plan(w.pid, entry)
        assert w.quit() == 0
        assert w.stderr() == ""


def test_a_process_that_never_drives_an_npu_is_left_alone(tmp_path):
    # the API server and a multi-process engine core: the watcher gives up quietly
    with running_daemon(str(tmp_path)) as d, \
            standin(tmp_path, "engine", ASCENDBIND_SOCKET=d.sock, ASCENDBIND_PLUGIN_WAIT_SECONDS="1") as e:
        assert e.ask("join") == "done"
        assert e.ask("watchers") == "0"
        assert held(d) == {}
        assert e.quit() == 0
        assert e.stderr() == ""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two NPUs need two CPUs to tell apart")
def test_tensor_parallel_workers_each_bind_their_own_npu(tmp_path):
    # vLLM starts one worker per device index; with ASCEND_RT_VISIBLE_DEVICES=1,0
    # device 0 is NPU 1 and device 1 is NPU 0
    env = {"ASCEND_RT_VISIBLE_DEVICES": "1,0"}
    with running_daemon(str(tmp_path), ASCENDBIND_FAKE_NPUS="2") as d, \
            standin(tmp_path, "rank0", ASCENDBIND_SOCKET=d.sock, **env) as r0, \
            standin(tmp_path, "rank1", ASCENDBIND_SOCKET=d.sock, **env) as r1:
        r0.ask("drive 0")
        r1.ask("drive 1")
        assert r0.ask("join") == "done" and r1.ask("join") == "done"
        assert wait_for(lambda: {r0.pid, r1.pid} <= set(held(d)), 30), d.log()
        workers = held(d)
        assert workers[r0.pid]["npus"] == [1] and workers[r1.pid]["npus"] == [0]
        pools = []
        for s in (r0, r1):
            assert_threads_follow_plan(s.pid, workers[s.pid])
            (npu_plan,) = workers[s.pid]["plan"]["npus"].values()
            pools.append(set(npu_plan["pool"]))
            assert s.stderr() == ""
        assert pools[0] and pools[1] and not pools[0] & pools[1]


def test_a_forked_worker_carries_on_its_parents_watch(tmp_path):
    # vLLM's default start method is fork, and a forked worker does not run plugins again
    with running_daemon(str(tmp_path)) as d, \
            standin(tmp_path, "engine", ASCENDBIND_SOCKET=d.sock, ASCENDBIND_PLUGIN_WAIT_SECONDS="120") as e:
        child = int(e.ask("fork 0"))
        assert wait_for(lambda: child in held(d), 60), d.log() + e.stderr()
        entry = held(d)[child]
        assert entry["npus"] == [0]
        (npu_plan,) = entry["plan"]["npus"].values()
        for tid in os.listdir(f"/proc/{child}/task"):
            allowed = cpus_allowed_of(child, int(tid))
            assert allowed is None or allowed == frozenset(npu_plan["main"])
        assert e.pid not in held(d)
        assert e.quit() == 0
        assert e.stderr() == ""


def test_without_a_daemon_the_worker_gets_one_warning_and_carries_on(tmp_path):
    with standin(tmp_path, "worker", ASCENDBIND_SOCKET=str(tmp_path / "absent.sock")) as w:
        w.ask("drive 0")
        assert w.ask("join") == "done"
        assert w.ask("watchers") == "0"      # still answering: the worker carries on
        assert w.quit() == 0
        lines = [line for line in w.stderr().splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert "ascendbind" in lines[0] and "not bound (device index 0)" in lines[0] and "absent.sock" in lines[0]


def test_a_refused_binding_is_one_warning_too(tmp_path):
    # ASCEND_RT_VISIBLE_DEVICES=3 makes device 0 the fourth NPU, which this one-NPU host does not have
    with running_daemon(str(tmp_path)) as d, \
            standin(tmp_path, "worker", ASCENDBIND_SOCKET=d.sock, ASCEND_RT_VISIBLE_DEVICES="3") as w:
        w.ask("drive 0")
        assert w.ask("join") == "done"
        assert w.quit() == 0
        lines = [line for line in w.stderr().splitlines() if line.strip()]
        assert len(lines) == 1 and "not bound (device index 0)" in lines[0] and "[npu_mismatch]" in lines[0], lines
        assert "names index 3" in lines[0]
        assert held(d) == {}


def test_a_daemon_that_cannot_read_the_host_is_asked_again_then_one_warning(tmp_path, caplog):
    # npu-smi fails (a fixture host with no recordings): every bind answers 503
    with running_daemon(str(tmp_path), ASCENDBIND_FIXTURE_HOST=str(tmp_path / "no-host")) as d:
        with caplog.at_level(logging.WARNING, logger="ascendbind.integrations"):
            answer = bind_current_process(0, socket_path=d.sock, retry_delays=(0.01, 0.01))
        assert answer is None
        warnings = [r.getMessage() for r in caplog.records if r.name == "ascendbind.integrations"]
        assert len(warnings) == 1 and "after 3 tries" in warnings[0], warnings
        assert metric_value(d.metrics_text(), "ascendbind_bind_requests_total", outcome="failed") == 3
        assert held(d) == {}


def test_a_device_past_the_visible_list_is_not_guessed(tmp_path):
    # a device index past ASCEND_RT_VISIBLE_DEVICES: no guess, no request, one warning
    with running_daemon(str(tmp_path)) as d, \
            standin(tmp_path, "worker", ASCENDBIND_SOCKET=d.sock, ASCEND_RT_VISIBLE_DEVICES="0") as w:
        w.ask("drive 1")
        assert w.ask("join") == "done"
        assert w.quit() == 0
        lines = [line for line in w.stderr().splitlines() if line.strip()]
        assert len(lines) == 1 and "device index 1" in lines[0], lines
        assert held(d) == {}


def test_vllm_plugins_can_leave_ascendbind_out(tmp_path):
    with standin(tmp_path, "worker", VLLM_PLUGINS="someone_else") as w:
        assert w.ask("watchers") == "0"
        assert w.quit() == 0
