"""A hanging or failing npu-smi: one timeout, nothing left running, failures cached.

Real processes throughout: a fake npu-smi (tests/hanging_tool.py) that forks a
grandchild and hangs, LiveHost running it, the daemon's HostCache on top.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from ascendbind import command
from ascendbind.values.config import Config
from ascendbind.daemon.host.hostcache import HOST_FACTS, PROCESS_TABLE, HostCache, backoff_delay
from ascendbind.discovery import LiveHost, discover_host
from ascendbind.discovery.read.sources import OneTimeoutPerTool
from ascendbind.errors import CommandFailed, DiscoveryUnavailable
from tests.daemon_harness import wait_for
from tests.hanging_tool import HangingNpuSmi

HOSTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hosts")
A2 = os.path.join(HOSTS, "a2-8x910b3")
TIMEOUT = 0.5  # where every run hangs
ANSWERS = 2.0  # where some runs must answer (each a `cat`), however loaded the machine


def live(fake: HangingNpuSmi, timeout: float = TIMEOUT) -> LiveHost:
    return LiveHost(npu_smi=str(fake.path), timeout=timeout)


def test_a_timeout_kills_the_whole_group_once_and_is_not_retried(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    with pytest.raises(CommandFailed) as err:
        live(fake).run(["npu-smi", "info"])
    assert err.value.code == "command_timeout"
    assert str(err.value) == f"command npu-smi info timed out after {TIMEOUT:g}s"
    assert fake.calls() == ["info"]  # one run: a timeout is not tried again
    assert fake.hung_runs() == 1  # the grandchild existed ...
    assert fake.wait_no_survivors() == []  # ... and died with its group


def test_a_clean_run_is_unchanged(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    out = live(fake, timeout=30).run(["npu-smi", "info", "-m"])
    assert "910B3" in out and fake.calls() == ["info -m"]
    with pytest.raises(CommandFailed, match=r"command npu-smi info -t nonsense exited \d+"):
        live(fake, timeout=30).run(["npu-smi", "info", "-t", "nonsense"])
    assert fake.hung_runs() == 0


def test_ctrl_c_while_waiting_also_kills_the_group(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    exe = str(fake.path)

    main = threading.main_thread().ident

    def interrupt_once_hung():
        wait_for(lambda: fake.hung_runs() == 1, 20, 0.02)
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, delivered where the wait blocks

    # A shell that starts the suite in the background leaves SIGINT ignored, and then
    # Python never raises KeyboardInterrupt: install the usual handler for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=interrupt_once_hung)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            command.run_command([exe, "info"], timeout=60)
    finally:
        t.join()
        signal.signal(signal.SIGINT, previous)
    assert fake.wait_no_survivors() == []


def test_a_busy_binary_is_retried_then_named(tmp_path):
    # ETXTBSY: the kernel refuses to exec a file open for writing (an upgrade in progress)
    fake = HangingNpuSmi(tmp_path)
    fd = os.open(fake.path, os.O_WRONLY)
    try:
        with pytest.raises(CommandFailed, match="could not start: Text file busy"):
            live(fake).run(["npu-smi", "info"])
        assert command._spawn.statistics["attempt_number"] == command.SPAWN_ATTEMPTS
    finally:
        os.close(fd)
    assert fake.calls() == []
    assert "NPU" in live(fake, timeout=30).run(["npu-smi", "info"])
    assert command._spawn.statistics["attempt_number"] == 1


def test_one_discovery_pass_pays_one_timeout_for_every_board_query(tmp_path):
    # eight NPUs, eight board queries: only the first may wait out the timeout
    fake = HangingNpuSmi(tmp_path, host_dir=A2)
    fake.hang("info -t board")
    facts = discover_host(OneTimeoutPerTool(live(fake, timeout=ANSWERS)), Config())
    assert len(facts.chips) == 8 and facts.pci_addresses == {}
    board = [c for c in fake.calls() if c.startswith("info -t board")]
    assert board == ["info -t board -i 0"]
    skipped = [w for w in facts.warnings if "not run" in w]
    assert len(skipped) == 7 and all("timed out" in w for w in skipped)
    assert fake.wait_no_survivors() == []


@pytest.mark.parametrize("failures,delay", [(1, 2.0), (2, 4.0), (3, 8.0), (5, 30.0), (50, 30.0), (10_000, 30.0)])
def test_backoff_doubles_up_to_its_cap(failures, delay):
    assert backoff_delay(failures, 2.0, 30.0) == delay


def _cache(fake: HangingNpuSmi, timeout: float = TIMEOUT, **kw) -> HostCache:
    cfg = Config(npu_smi=str(fake.path), command_timeout_seconds=timeout)
    return HostCache(cfg, **kw)


def test_a_failed_host_discovery_is_answered_from_the_cache_until_a_retry_succeeds(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    # a long backoff: no background retry can run while the test looks
    cache = _cache(fake, backoff_initial=600)
    try:
        with pytest.raises(CommandFailed, match="timed out"):
            cache.get()
        assert fake.calls() == ["info -m"]  # the first query failed: nothing else was run
        for _ in range(5):
            with pytest.raises(DiscoveryUnavailable) as err:
                cache.get()
            assert "command_timeout" in str(err.value) and "npu-smi info -m" in str(err.value)
        assert fake.calls() == ["info -m"]
        health = cache.health()
        assert health["status"] == "degraded"
        assert [(f["query"], f["error"], f["failures"]) for f in health["failing"]] == [
            (HOST_FACTS, "command_timeout", 1)]
        assert "npu-smi info -m timed out" in health["failing"][0]["detail"]
        assert 0 < health["failing"][0]["retry_in_seconds"] <= 600
    finally:
        cache.close()
    assert fake.wait_no_survivors() == []


def test_the_background_retry_backs_off_and_recovers(tmp_path):
    fake = HangingNpuSmi(tmp_path, host_dir=A2)
    fake.hang()
    cache = _cache(fake, backoff_initial=0.05, backoff_max=0.2)
    try:
        with pytest.raises(CommandFailed):
            cache.get()
        # retries run by themselves, each a fresh failure counted
        assert wait_for(lambda: cache.health()["failing"][0]["failures"] >= 3, 30, 0.02), cache.health()
        assert fake.hung_runs() >= 3
        with pytest.raises(DiscoveryUnavailable):
            cache.get()
        cache.set_config(cache.config.replace(command_timeout_seconds=ANSWERS))  # as a SIGHUP would
        fake.answer()
        assert wait_for(lambda: cache.health()["status"] == "ok", 30, 0.02), cache.health()
        assert cache.health()["failing"] == [] and cache.status == "ok"
        assert cache.get().chips  # served from the cache now
    finally:
        cache.close()
    assert fake.wait_no_survivors() == []


def test_a_failing_process_table_is_cached_on_its_own(tmp_path):
    fake = HangingNpuSmi(tmp_path, host_dir=A2)
    cache = _cache(fake, ANSWERS, backoff_initial=600)
    try:
        facts = cache.get()
        assert sorted(p.pid for p in cache.processes()) == [4242, 4343]
        assert cache.health()["status"] == "ok"
        cache.set_config(cache.config.replace(command_timeout_seconds=TIMEOUT))  # as a SIGHUP would
        fake.hang("info")
        before = len(fake.calls())
        with pytest.raises(CommandFailed, match=f"npu-smi info timed out after {TIMEOUT:g}s"):
            cache.processes()
        assert len(fake.calls()) == before + 1
        for _ in range(5):
            with pytest.raises(DiscoveryUnavailable, match="process table"):
                cache.processes()
        assert len(fake.calls()) == before + 1  # failing fast ran nothing
        assert cache.get() is facts  # the static facts do not depend on it
        health = cache.health()
        assert health["status"] == "degraded" and [f["query"] for f in health["failing"]] == [PROCESS_TABLE]
        assert PROCESS_TABLE in health["discovery"]
    finally:
        cache.close()
    assert fake.wait_no_survivors() == []


def test_concurrent_requests_share_one_hung_run(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    cache = _cache(fake, backoff_initial=600)
    errors: list[str] = []

    def ask():
        try:
            cache.get()
        except Exception as exc:  # noqa: BLE001 - the test collects what each request got
            errors.append(type(exc).__name__)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        cache.close()
    assert len(errors) == 6 and errors.count("CommandFailed") == 1
    assert fake.calls() == ["info -m"]
    assert fake.wait_no_survivors() == []


def test_no_timer_outlives_close(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    cache = _cache(fake, backoff_initial=600)
    with pytest.raises(CommandFailed):
        cache.get()
    assert any(t.name == f"retry-{HOST_FACTS}" for t in threading.enumerate())
    cache.close()
    assert wait_for(lambda: not any(t.name == f"retry-{HOST_FACTS}" for t in threading.enumerate()), 10, 0.02)
    with pytest.raises(DiscoveryUnavailable):
        cache.get()  # still cached: closing forgets the retry, not the failure
    assert fake.calls() == ["info -m"]


def test_stop_commands_kills_what_runs_and_refuses_what_comes_after(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    exe = str(fake.path)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            command.run_command([exe, "info"], timeout=120)
        except BaseException as exc:  # noqa: BLE001 - the test reads what the caller got
            raised.append(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert wait_for(lambda: fake.hung_runs() == 1, 20, 0.02)
        assert command.stop_commands() == []  # every group killed and its leader reaped
        t.join(timeout=10)
        assert not t.is_alive()
        assert isinstance(raised[0], command.CommandsStopped) and raised[0].killed
        assert fake.wait_no_survivors(timeout=1.0) == []
        with pytest.raises(command.CommandsStopped, match="not started because the daemon is stopping"):
            command.run_command([exe, "info", "-m"], timeout=120)
        assert fake.calls() == ["info"]  # refused before any spawn
        with pytest.raises(CommandFailed, match=r"^command npu-smi info -m not started because the daemon"):
            live(fake, timeout=120).run(["npu-smi", "info", "-m"])
    finally:
        command.allow_commands()
        t.join(timeout=10)
    fake.answer()
    assert "910B3" in command.run_command([exe, "info", "-m"], timeout=30).stdout
