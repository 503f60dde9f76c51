"""Each shipped alert fires and resolves in a real Prometheus scraping a real daemon.

A Prometheus server (Debian's ``prometheus`` binary; tests/prometheus_harness.py)
runs on a free loopback port with a temp data dir and a *test-only copy* of
deploy/prometheus/ascendbind.rules.yml whose durations (``for:`` and every
range) are divided by 120, scraping and evaluating every 500 ms: the shipped
expressions, compressed in time. It scrapes ``ascendbind serve``'s
``metrics_listen`` as job ``ascendbind`` and a stand-in for Ascend's
NPU-Exporter (this machine has no NPU), both labelled ``node="ci"``.

Each condition is made true for real and undone: a bind that cannot be
planned, a bind admitted without NUMA alignment, a worker that keeps undoing
its binding until the daemon leaves it alone, an npu-smi that fails from the
start, the daemon killed, the target gone from the configuration, NPU
processes while no worker is bound, a worker's threads waiting for their CPUs.
The test reads ``/api/v1/alerts`` until
the alert is firing, then until it is no longer active (resolved).

The daemon sees a two-NUMA-node picture of this machine's CPUs 0 and 1 (CI has
one node; the same fake host as the alignment tests): npu-smi and lscpu replay
it, ``sys_root`` holds its node distances; the workers and their masks are real.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_harness import FIXTURE_BIN, DaemonProc, base_env, free_port, wait_for
from tests.deploy_tools import RULES
from tests.prometheus_harness import FakeNpuExporter, compressed_rules, running_prometheus
from tests.test_daemon_alignment_metrics import two_node_host
from tests.workers import SELF_BINDER, reap, start_worker

pytestmark = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")

SHIPPED_ALERTS = {"AscendbindDaemonDown", "AscendbindTargetsMissing", "AscendbindBindsFailing",
                  "AscendbindBindsUnaligned", "AscendbindDriftLeftAlone", "AscendbindDiscoveryFailing",
                  "AscendbindNoBoundWorkers", "AscendbindPoolContended"}


class World:
    """One Prometheus, one fake exporter, one fake host; a daemon per test on one port."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.host = directory / "host"
        two_node_host(str(self.host))
        (self.host / "sys/devices/system/cpu").mkdir(parents=True)
        (self.host / "sys/devices/system/cpu/online").write_text("0-1\n")
        self.bin = directory / "bin"
        self.bin.mkdir()
        _replay_tool(self.bin / "lscpu", self.host)
        self.port = free_port()
        self.exporter = FakeNpuExporter()
        self.targets = {"ascendbind": [f"127.0.0.1:{self.port}"], "npu-exporter": [self.exporter.address]}
        self.alerts = compressed_rules(RULES, directory / "rules.yml")
        self.runs = 0

    def daemon(self, **extra: str) -> DaemonProc:
        self.runs += 1
        run = self.dir / f"daemon-{self.runs}"
        run.mkdir()
        env = base_env(str(run / "ascendbind.sock"), str(run / "state"), self.port,
                       ASCENDBIND_FIXTURE_HOST=str(self.host), ASCENDBIND_SYS_ROOT=str(self.host / "sys"),
                       **extra)
        env["PATH"] = f"{self.bin}:{env['PATH']}"
        return DaemonProc(str(run), env)

    @contextlib.contextmanager
    def running(self, **extra: str) -> Iterator[DaemonProc]:
        """A daemon on the scraped port, stopped on the way out."""
        d = self.daemon(**extra).start()
        try:
            yield d
        finally:
            d.stop()


def _replay_tool(path: Path, host: Path) -> None:
    """A tool that prints the fake host's ``cmd/<tool>_<args>.txt`` (the snapshot layout)."""
    path.write_text("#!/bin/sh\n"
                    f'words="{path.name}"; [ $# -eq 0 ] || words="$words $*"\n'
                    f'f="{host}/cmd/$(printf %s "$words" | tr " " _).txt"\n'
                    '[ -r "$f" ] || { echo "unsupported: $*" >&2; exit 2; }\n'
                    'exec cat "$f"\n')
    path.chmod(0o755)


@pytest.fixture(scope="module")
def world():
    directory = Path(tempfile.mkdtemp(prefix="ascendbind-prom-", dir="/tmp"))
    w = World(directory)
    try:
        with running_prometheus(directory, directory / "rules.yml", w.targets) as prom:
            w.prom = prom
            print(f"\n{prom.version}; rules compressed 120x, scrape and evaluation every 500 ms")
            yield w
    finally:
        w.exporter.close()
        shutil.rmtree(directory, ignore_errors=True)


def _scraped(world: World) -> bool:
    return any(r["value"][1] == "1" for r in world.prom.query('up{job="ascendbind"}'))


@pytest.fixture
def daemon(world):
    with world.running() as d:
        d.wait_discovered()
        assert wait_for(lambda: _scraped(world), 30), world.prom.log()[-2000:]
        yield d


def test_the_test_copy_holds_every_shipped_alert_compressed(world):
    assert set(world.alerts) == SHIPPED_ALERTS
    assert set(world.prom.rule_states()) == SHIPPED_ALERTS  # the server loaded all of them
    assert world.alerts["AscendbindDaemonDown"]["for"] == "2500ms"  # 5m / 120
    assert "[15000ms]" in world.alerts["AscendbindDriftLeftAlone"]["expr"]  # 30m / 120
    assert "for: 5m" in RULES.read_text()  # the shipped file is what it was


def test_bind_alerts_fire_on_real_binds_and_resolve(world, daemon):
    prom = world.prom
    for name in ("AscendbindBindsFailing", "AscendbindBindsUnaligned", "AscendbindDriftLeftAlone",
                 "AscendbindNoBoundWorkers"):
        assert prom.wait_alert(name, None) >= 0  # nothing raised yet: each can fail
    world.exporter.processes = 1  # NPU processes run, and the daemon holds no worker
    try:
        prom.wait_alert("AscendbindNoBoundWorkers", "firing")
        with start_worker(plain=1, acl=0, release=0) as w:
            binder = subprocess.Popen([sys.executable, "-c", SELF_BINDER], stdout=subprocess.PIPE, text=True)
            try:
                assert binder.stdout.readline().strip() == "ready"
                # each alert is read right after its cause: a window is seconds long here
                status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 7})  # no such NPU
                assert status == 422, body
                prom.wait_alert("AscendbindBindsFailing", "firing")
                status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
                assert status == 200 and body["outcome"] == "unaligned", body
                prom.wait_alert("AscendbindBindsUnaligned", "firing")
                prom.wait_alert("AscendbindNoBoundWorkers", None)
                status, body = daemon.curl("POST", "/v1/bind", {"pid": binder.pid, "npu": 1})
                assert status == 200, body
                # the binder undoes the masks until the daemon stops re-asserting them
                assert wait_for(lambda: daemon.client.worker(binder.pid)["drift"]["left_alone"], 30), \
                    daemon.log()[-3000:]
                prom.wait_alert("AscendbindDriftLeftAlone", "firing")
            finally:
                reap(binder)
        world.exporter.processes = 0
        # no new failure, unaligned bind or drift: each resolves once its window has passed
        for name in ("AscendbindBindsFailing", "AscendbindBindsUnaligned", "AscendbindDriftLeftAlone"):
            prom.wait_alert(name, None)
        assert prom.alerts().get("AscendbindNoBoundWorkers") is None
    finally:
        world.exporter.processes = 0


def test_pool_contended_fires_while_a_workers_threads_wait_for_their_cpus_and_resolves(world, daemon):
    """Four ACL threads of a bound worker burn at once on its one ACL CPU: each waits for
    the others, the exported run delay rises beside the CPU time, and the alert fires;
    when they are done, it resolves."""
    prom = world.prom
    prom.wait_alert("AscendbindPoolContended", None)
    with start_worker(plain=1, acl=1, release=1) as w:
        status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, body
        burning = threading.Thread(target=w.burn, args=("acl_thread", 3000, 4))
        burning.start()
        try:
            prom.wait_alert("AscendbindPoolContended", "firing")
        finally:
            burning.join(120)
        prom.wait_alert("AscendbindPoolContended", None)
        acl = daemon.client.worker(w.pid)["contention"]["roles"]["acl"]
        assert acl["run_delay_seconds"] > 0.25 * (acl["run_delay_seconds"] + acl["cpu_seconds"]), acl


def test_discovery_failing_from_the_start_fires_and_resolves_once_npu_smi_works(world):
    prom = world.prom
    npu_smi = world.dir / "npu-smi"
    _write_tool(npu_smi, '#!/bin/sh\necho "dcmi module initialize failed. ret is -8005" >&2\nexit 1\n')
    with world.running(ASCENDBIND_NPU_SMI=str(npu_smi)) as d:
        assert wait_for(lambda: _scraped(world), 30)
        prom.wait_alert("AscendbindDiscoveryFailing", "firing")
        _write_tool(npu_smi, f'#!/bin/sh\nexec "{FIXTURE_BIN / "npu-smi"}" "$@"\n')
        d.proc.send_signal(signal.SIGHUP)  # retries discovery at once
        d.wait_discovered()
        prom.wait_alert("AscendbindDiscoveryFailing", None)


def test_daemon_down_fires_while_it_is_killed_and_resolves_when_it_is_back(world, daemon):
    prom = world.prom
    prom.wait_alert("AscendbindDaemonDown", None)
    daemon.stop(signal.SIGKILL)
    prom.wait_alert("AscendbindDaemonDown", "firing")
    with world.running():
        prom.wait_alert("AscendbindDaemonDown", None)


def test_targets_missing_fires_without_any_ascendbind_target_and_resolves_with_one(world, daemon):
    prom = world.prom
    prom.wait_alert("AscendbindTargetsMissing", None)
    try:
        prom.set_targets({**world.targets, "ascendbind": []})  # a PodMonitor that selects no pod
        prom.wait_alert("AscendbindTargetsMissing", "firing")
    finally:
        prom.set_targets(world.targets)
    prom.wait_alert("AscendbindTargetsMissing", None)


def _write_tool(path: Path, text: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)
