"""The daemon's parts on their own: state file, peer authorization, request
validation, sd_notify, the listening socket, the hot-plug debouncer, metrics,
the reconcile loop's stop flag."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from ascendbind.discovery.gather.identity import require_identity
from ascendbind.daemon.runtime import systemd
from ascendbind.daemon.api.auth import Peer, authorize
from ascendbind.daemon.host.hotplug import Debouncer
from ascendbind.daemon.api.listen import open_listen_socket
from ascendbind.daemon.api.metrics import Metrics
from ascendbind.daemon.api.requests import PlanAsk, alignment_of, parse_bind_request, resolve_policy
from ascendbind.daemon.state.staterecord import binding_from_json, binding_to_json
from ascendbind.values.reasons import Outcome, Reason, Step
from ascendbind.values.frozen import frozen_map
from ascendbind.values.targeting import TargetRequest
from ascendbind.daemon.runtime.stopflag import StopFlag
from ascendbind.daemon.state.state import StateFile
from tests.daemon_harness import wait_for
from ascendbind.settings import load_config
from ascendbind.errors import ConfigError, Conflict, NotPermitted, ProcessGone, UsageError
from ascendbind.values.model import Binding, DeviceType, Mode, NpuPlan, Plan, StepResult

PLAN = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, (0, 1, 2, 3, 4), (
    NpuPlan(0, (0, 1, 2, 3, 4), (0, 1), (2,), (3,), (4,), (0,)),))
BINDING = Binding(4242, 777, (0,), PLAN, frozenset({0, 1, 2, 3, 4}), frozen_map({120: "00000001"}), (
    StepResult(Step.AFFINITY, Outcome.APPLIED, None, "bound 3 threads"),
    StepResult(Step.IRQ, Outcome.SKIPPED, Reason.NO_MSI_IRQS, "none", frozen_map({"previous": {}})),
))


# ---------------------------------------------------------------- state file


def test_state_round_trips_a_binding(tmp_path):
    sf = StateFile(str(tmp_path / "st"))
    sf.save([binding_to_json(BINDING, bound_at=1.5)])
    assert stat.S_IMODE(os.stat(sf.path).st_mode) == 0o600
    assert os.listdir(sf.dir) == ["state.json"]  # no temp file left behind
    loaded = sf.load()
    assert loaded.moved_aside is None and len(loaded.workers) == 1
    # the record keeps each step's outcome, reason and sentence, not its report data
    kept = dataclasses.replace(BINDING, steps=tuple(dataclasses.replace(s, data=frozen_map()) for s in BINDING.steps))
    assert binding_from_json(loaded.workers[0]) == kept


def test_state_with_a_bad_checksum_is_moved_aside(tmp_path):
    sf = StateFile(str(tmp_path))
    sf.save([binding_to_json(BINDING)])
    doc = json.loads(open(sf.path).read())
    doc["workers"][0]["pid"] = 1  # tampered
    with open(sf.path, "w") as fh:
        json.dump(doc, fh)
    os.chmod(sf.path, 0o600)
    result = sf.load()
    assert result.workers == [] and "checksum" in result.problem
    assert not os.path.exists(sf.path) and os.path.exists(result.moved_aside)


@pytest.mark.parametrize("content", ["", "{", "[]", '{"version": 99, "boot_id": "x", "workers": []}'])
def test_unreadable_state_never_raises(tmp_path, content):
    sf = StateFile(str(tmp_path))
    with open(sf.path, "w") as fh:
        fh.write(content)
    os.chmod(sf.path, 0o600)
    result = sf.load()
    assert result.workers == [] and result.moved_aside


def test_state_of_another_boot_is_dropped_whole(tmp_path):
    old = StateFile(str(tmp_path))
    old.boot_id = "00000000-0000-0000-0000-000000000000"
    old.save([binding_to_json(BINDING)])
    result = StateFile(str(tmp_path)).load()
    assert result.workers == [] and result.other_boot == 1 and result.moved_aside is None


def test_state_writable_by_others_is_not_trusted(tmp_path):
    sf = StateFile(str(tmp_path))
    sf.save([binding_to_json(BINDING)])
    os.chmod(sf.path, 0o666)
    result = sf.load()
    assert result.workers == [] and "writable" in result.problem


# ---------------------------------------------------------------- authorization (real processes)


@pytest.fixture
def nobody_tree():
    """A uid-65534 shell with a uid-65534 child: (parent pid, child pid)."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not installed")
    proc = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c",
                             "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        yield proc.pid, child
    finally:
        proc.kill()
        proc.wait()
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass


def _authorize(peer: Peer, pid: int) -> None:
    # the test runner plays no daemon here: daemon_pid 0 is no process
    authorize(peer, require_identity(pid), daemon_pid=0)


def test_root_may_bind_any_live_pid_and_nobody_only_its_own_descendants(nobody_tree):
    parent, child = nobody_tree
    _authorize(Peer(os.getpid(), 0, 0), os.getpid())
    _authorize(Peer(parent, 65534, 65534), child)  # its own child
    _authorize(Peer(child, 65534, 65534), child)  # itself
    with pytest.raises(NotPermitted, match="neither the caller"):
        _authorize(Peer(child, 65534, 65534), parent)  # its parent is not its descendant
    with pytest.raises(NotPermitted, match="does not belong to uid"):
        _authorize(Peer(parent, 65534, 65534), os.getpid())  # a root process
    with pytest.raises(ProcessGone):
        _authorize(Peer(os.getpid(), 0, 0), 4194303)


# ---------------------------------------------------------------- request values


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, (None, TargetRequest(), PlanAsk())),
        ({"pid": 7, "npu": 3}, (7, TargetRequest(npus=(3,)), PlanAsk())),
        ({"npu": [2, 1, 2]}, (None, TargetRequest(npus=(1, 2)), PlanAsk())),
        ({"npu": 0, "topology_policy": "restricted"}, (None, TargetRequest(npus=(0,)), PlanAsk("restricted"))),
        ({"npu": 0, "pool_source": "auto"}, (None, TargetRequest(npus=(0,)), PlanAsk(pool_source="auto"))),
        ({"device_index": 1, "env": {"ASCEND_VISIBLE_DEVICES": "5", "ASCEND_RT_VISIBLE_DEVICES": "0"}},
         (None, TargetRequest(device_index=1, env={"ASCEND_VISIBLE_DEVICES": "5", "ASCEND_RT_VISIBLE_DEVICES": "0"}),
          PlanAsk())),
    ],
)
def test_bind_bodies_that_are_fine(body, expected):
    assert parse_bind_request(body) == expected


@pytest.mark.parametrize("body", [[], "x", {"pid": 0}, {"pid": 1.5}, {"npu": True}, {"npu": []},
                                  {"npu": [0] * 65}, {"extra": 1}, {"topology_policy": 3},
                                  {"npu": 1, "device_index": 0}, {"device_index": -1}, {"device_index": "0"},
                                  {"env": ["ASCEND_VISIBLE_DEVICES=5"]}, {"env": {"HF_TOKEN": "x"}},
                                  {"env": {"ASCEND_VISIBLE_DEVICES": 5}},
                                  {"env": {"ASCEND_VISIBLE_DEVICES": "0," * 600}}])
def test_bind_bodies_that_are_not(body):
    with pytest.raises(UsageError):
        parse_bind_request(body)


def test_request_policy_must_not_contradict_the_node():
    node = load_config(None, env={"ASCENDBIND_TOPOLOGY_POLICY": "restricted"})
    assert resolve_policy(None, node).topology_policy == "restricted"
    assert resolve_policy("restricted", node).topology_policy == "restricted"
    with pytest.raises(Conflict) as err:
        resolve_policy("best-effort", node)
    assert err.value.code == "policy_mismatch" and err.value.exit_status == 9
    assert resolve_policy("best-effort", load_config(None, env={})).topology_policy == "best-effort"


def test_request_pool_source_must_not_contradict_the_node():
    # a node that names its pool source decides it; one that leaves the default lets the request choose
    free = load_config(None, env={})
    assert resolve_policy(PlanAsk(pool_source="cpuset"), free).pool_source == "cpuset"
    assert resolve_policy(PlanAsk(), free) is free
    node = load_config(None, env={"ASCENDBIND_POOL_SOURCE": "slice"})
    assert resolve_policy(PlanAsk(pool_source="slice"), node).pool_source == "slice"
    with pytest.raises(Conflict) as err:
        resolve_policy(PlanAsk(pool_source="cpuset"), node)
    assert err.value.code == "policy_mismatch" and "pool_source cpuset" in str(err.value)


def test_alignment_outcome_is_the_planners_report_and_survives_the_state_file():
    from ascendbind.discovery import SnapshotHost, discover_host, discover_worker
    from ascendbind.planner import make_plan

    src = SnapshotHost(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "fixtures", "hosts", "a2-8x910b3"))
    cfg = load_config(None, env={})
    host, worker = discover_host(src, cfg), discover_worker(src, None, cfg)
    # the A2 example: the seed pool of NPU3 lies on the neighbour node
    seed = make_plan(host, worker, (3,), cfg)
    assert alignment_of(seed) == (False, "pool_off_mask")
    assert alignment_of(Plan.from_json(seed.to_json())) == (False, "pool_off_mask")
    single = make_plan(host, worker, (3,), cfg, request_policy="single-numa-node")
    assert alignment_of(single) == (True, None)
    # a plan without the planner's block (an old state file) was never evaluated
    assert alignment_of(PLAN) == (False, None)


# ---------------------------------------------------------------- systemd protocols, socket


def test_sd_notify_sends_one_datagram(tmp_path, monkeypatch):
    path = str(tmp_path / "n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert systemd.notify("READY=1", "STATUS=up")
        assert s.recv(100) == b"READY=1\nSTATUS=up"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert systemd.notify("READY=1") is False


def test_listen_fds_only_for_our_pid(monkeypatch):
    monkeypatch.setenv("LISTEN_PID", "1")
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert systemd.listen_fds() == [] and "LISTEN_PID" not in os.environ


def test_created_socket_is_0660_and_replaces_only_a_stale_socket(tmp_path):
    path = str(tmp_path / "run" / "a.sock")
    sock, how, owned = open_listen_socket(path)
    assert (how, owned) == ("created", True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    with pytest.raises(ConfigError, match="already listening"):
        open_listen_socket(path)
    sock.close()  # now the file is stale
    sock2, _, _ = open_listen_socket(path)
    sock2.close()
    os.unlink(path)
    with open(path, "w") as fh:
        fh.write("precious")
    with pytest.raises(ConfigError, match="not a socket"):
        open_listen_socket(path)
    with pytest.raises(ConfigError, match="not a group"):
        open_listen_socket(str(tmp_path / "b.sock"), "no-such-group-ascendbind")


# ---------------------------------------------------------------- hot-plug debounce, metrics


def test_a_burst_of_pokes_fires_once_after_the_quiet_period():
    calls = []
    fired = threading.Event()
    d = Debouncer(0.3, lambda: (calls.append(time.monotonic()), fired.set()))
    try:
        for _ in range(5):
            before_last = time.monotonic()
            d.poke()
        assert d.pending()
        assert fired.wait(10)
        # the deadline moved with every poke: nothing fires before the last one + delay
        assert calls[0] >= before_last + 0.3
        assert wait_for(lambda: not d.pending(), 10)
        assert (len(calls), d.fired, d.pokes) == (1, 1, 5)
        # a later burst fires again, once
        fired.clear()
        d.poke()
        d.poke()
        assert fired.wait(10) and wait_for(lambda: not d.pending(), 10)
        assert (len(calls), d.fired, d.pokes) == (2, 2, 7)
    finally:
        d.close()
    d.poke()  # closed: ignored, nothing becomes due
    assert not d.pending() and d.pokes == 7


def test_a_closed_debouncer_drops_what_was_due():
    calls = []
    d = Debouncer(30, lambda: calls.append(1))
    d.poke()
    assert d.pending()
    d.close()
    assert not d.pending() and calls == [] and d.fired == 0


def test_metric_labels_come_from_fixed_sets():
    m = Metrics()
    m.bind_outcome("exploded")  # unknown -> failed, never a new series
    m.alignment_failure("some free text")
    m.drifted("pid 4242")
    m.http_request("/v1/../../etc", 299)
    text = m.render().decode()
    assert 'outcome="exploded"' not in text and "free text" not in text and "4242" not in text
    assert 'ascendbind_bind_requests_total{outcome="failed"} 1.0' in text
    assert 'ascendbind_alignment_failures_total{reason="other"} 1.0' in text
    assert 'path="other"' in text and "_created" not in text


def test_client_imports_only_the_standard_library():
    code = ("import sys, ascendbind.client; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('structlog', 'prometheus_client', 'tenacity', 'pyudev', 'psutil')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_stop_flag_ends_a_long_wait_at_once_and_stays_set():
    flag = StopFlag()
    assert flag.wait(0.01) is False and not flag.is_set()  # a wait that times out says so
    woke: list[bool] = []
    sleeper = threading.Thread(target=lambda: woke.append(flag.wait(600)))
    sleeper.start()
    flag.set()
    sleeper.join(30)  # a wake-up lost between the check and the poll would hold it 600 s
    assert not sleeper.is_alive() and woke == [True]
    assert flag.wait(600) is True  # set for good: later waits return at once
    flag.close()
    assert flag.wait(600) is True and flag.is_set()
