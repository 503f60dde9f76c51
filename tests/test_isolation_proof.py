"""Who may isolate: only a binding proven to drive its NPU, or asked for by root, moves
the rest of the host off its CPUs and holds its NPU against another worker.

The rules (daemon/watch/proof.py, api/requests.py claim_npus) are tables of values
here. The effects are real: an unprivileged caller is a process of uid 1234 that
posts its own bind to the daemon's socket. ``host`` runs in a pid namespace of its
own (tests/hostlevel_ns.py, as tests/test_isolation_host.py), ``irqs`` on this
machine's real IRQs (as tests/test_isolation_daemon.py, every mask put back), and
every mask is read back from ``/proc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ascendbind.daemon.api.requests import claim_npus
from ascendbind.daemon.watch.held import Held
from ascendbind.daemon.watch.npucheck import listed_verdict
from ascendbind.daemon.watch.proof import Proof, kept_on_rebind, pod_at_top, proof_of, prove
from ascendbind.errors import Conflict
from ascendbind.values.cpulist import format_cpulist, parse_cpulist
from ascendbind.values.model import WorkerFacts
from ascendbind.values.targeting import DeviceNode, EvidenceLine, NpuEvidence, TargetDecision
from ascendbind.discovery.gather.irqhost import read_irq_mask
from ascendbind.applier.irq import set_irq_affinity
from ascendbind.values.cpulist import parse_mask
from tests.daemon_harness import FIXTURE_BIN, PATIENCE, DaemonProc, base_env, free_port, wait_for
from tests.hostlevel_ns import CHILD, as_user
from tests.test_isolation_daemon import assert_off_the_protected_cpus, changed, daemon, isolation, masks  # noqa: F401
from tests.test_isolation_host import STARTED_ON, moved, ns, only  # noqa: F401
from tests.test_state_record import _a2_binding
from tests.test_write_ahead import _changeable_irqs, _npu_host

# an unprivileged user with no name and no group but its own (``nobody_prefix``: the fixture
# that lets users other than root run this checkout's interpreter, or skips)
UID = 1234


# ---------------------------------------------------------------- the rule, as values


def _worker(pid=42, *, ev=None, cpuset=None) -> WorkerFacts:
    return WorkerFacts(pid=pid, start_time=1, allowed_cpus=frozenset({0, 1}), allowed_source="cgroup",
                       mems_allowed=frozenset({0}), env={}, cpuset_path=cpuset, npu_evidence=ev)


def _decision(rule="request", **lines) -> TargetDecision:
    return TargetDecision((1,), rule, "", tuple(EvidenceLine(k, v, f"{k} says {v}") for k, v in lines.items()))


CONTAINER = NpuEvidence(major=236, host_namespace=False, host_user_namespace=True,
                        device_nodes=(DeviceNode("davinci1", 236, 1),))
OWN_USERNS = NpuEvidence(major=236, host_namespace=False, host_user_namespace=False,
                         device_nodes=(DeviceNode("davinci1", 236, 1),))
POD = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a1b2c3d_0000_4000_8000_000000000001.slice/x"

PROOF_TABLE = [
    # (name, worker, decision, root uid, listed, proven by)
    ("root's request proves", _worker(), _decision(), 0, None, "root"),
    ("an unprivileged request naming the NPU proves nothing", _worker(), _decision(), 1234, None, "claim"),
    ("ASCEND_VISIBLE_DEVICES is the worker's own word", _worker(), _decision("visible_devices",
                                                                            visible_devices=(1,)), 1234, None, "claim"),
    ("the driver's map proves", _worker(), _decision("driver", driver=(1,)), 1234, None, "driver"),
    ("npu-smi's table in the evidence proves", _worker(), _decision(process_table=(1,)), 1234, None, "process_table"),
    ("npu-smi's table on another NPU does not", _worker(), _decision(process_table=(0,)), 1234, None, "claim"),
    ("a table read for the claim proves", _worker(), _decision(), 1234, {(1, 42)}, "process_table"),
    ("a table listing another pid does not", _worker(), _decision(), 1234, {(1, 7)}, "claim"),
    ("a runtime's container device set proves", _worker(ev=CONTAINER), _decision(device_nodes=(1,)), 1234, None,
     "container_devices"),
    ("a device set in a user namespace of the worker's own does not", _worker(ev=OWN_USERNS),
     _decision(device_nodes=(1,)), 1234, None, "claim"),
    ("a kubelet pod proves", _worker(cpuset=POD), _decision(), 1234, None, "kubelet_pod"),
    ("a cgroup named kubepods under a user's delegated tree does not",
     _worker(cpuset="/user.slice/user-1234.slice/user@1234.service" + POD), _decision(), 1234, None, "claim"),
]


@pytest.mark.parametrize("name,worker,decision,uid,listed,by", PROOF_TABLE, ids=[r[0] for r in PROOF_TABLE])
def test_what_proves_a_binding(name, worker, decision, uid, listed, by):
    proof = proof_of(worker, decision, (1,), root_uid=uid, listed=listed)
    assert (proof.by, proof.proven) == (by, by != "claim"), proof


def test_only_a_confirmed_check_proves_and_a_state_file_without_a_proof_is_unproven():
    unproven = Proof(False, "claim", "x")
    assert prove(unproven, "unlisted", "y") is unproven and prove(unproven, "unverified", "y") is unproven
    assert prove(unproven, "confirmed", "npu-smi lists it") == Proof(True, "npu_check", "npu-smi lists it")
    root = Proof(True, "root", "r")
    assert prove(root, "confirmed", "y") is root
    assert Proof.from_json(root.to_json()) == root and Proof.from_json(unproven.to_json()) == unproven
    for raw in (None, {}, {"proven": True, "by": "a_word_nobody_wrote", "detail": ""}, {"proven": "yes"}):
        assert not Proof.from_json(raw).proven, raw
    assert pod_at_top("/../.." + POD) and not pod_at_top(None) and not pod_at_top("/kubepods/burstable")


def test_the_same_process_bound_again_to_the_same_npus_keeps_its_proof():
    root, claim = Proof(True, "root", "r"), Proof(False, "claim", "c")
    assert kept_on_rebind(claim, root, (1,), (1,)) is root  # root's run, then the worker's own bind
    assert kept_on_rebind(claim, root, (1,), (0,)) is claim  # another NPU: a new claim
    assert kept_on_rebind(claim, claim, (1,), (1,)) is claim and kept_on_rebind(claim, None, (), (1,)) is claim
    driver = Proof(True, "driver", "d")
    assert kept_on_rebind(driver, root, (1,), (1,)) is driver  # weighed afresh when it proves itself


def test_a_held_record_keeps_its_proof_across_a_restart():
    h = Held(_a2_binding(), 1.0)
    h.proof = Proof(True, "npu_check", "npu-smi lists the worker on NPU(s) [1]")
    again = Held.from_state(h.binding, h.state_json(), 2.0)
    assert again.proof == h.proof and h.to_json()["proof"]["by"] == "npu_check"


CLAIMS = [
    # (name, holders (pid, npus, alive, proven), newcomer proven, listed, expect)
    ("a proven newcomer evicts an unproven holder", [(7, (1,), True, False)], True, None, ([], [7])),
    ("an unproven newcomer shares with an unproven holder", [(7, (1,), True, False)], False, None, ([], [])),
    ("an unproven newcomer never takes a proven holder's NPU", [(7, (1,), True, True)], False, {(1, 9)}, "npu_busy"),
    ("two proven: the holder keeps it", [(7, (1,), True, True)], True, None, "npu_busy"),
    ("two proven: npu-smi's word moves it", [(7, (1,), True, True)], True, {(1, 9)}, ([], [7])),
    ("a dead unproven holder is replaced", [(7, (1,), False, False)], False, None, ([7], [])),
]


@pytest.mark.parametrize("name,holders,proven,listed,expect", CLAIMS, ids=[r[0] for r in CLAIMS])
def test_only_a_proven_binding_holds_its_npu(name, holders, proven, listed, expect):
    if expect == "npu_busy":
        with pytest.raises(Conflict) as exc:
            claim_npus(9, (1,), holders, listed, proven=proven)
        assert exc.value.code == "npu_busy"
    else:
        assert claim_npus(9, (1,), holders, listed, proven=proven) == expect


def test_a_binding_without_its_facts_is_judged_by_the_listing_alone():
    class Row:
        def __init__(self, pid, npu):
            self.pid, self.npu = pid, npu

    assert listed_verdict(5, (1,), [Row(6, 1)])[0] == "unlisted"
    assert listed_verdict(5, (1,), [Row(5, 1)])[0] == "confirmed"
    assert listed_verdict(5, (0, 1), [Row(5, 1)])[0] == "unverified"


# ---------------------------------------------------------------- host, in a pid namespace


def squat(ns, comm: str = "squatter", threads: int = 2) -> tuple[int, dict]:
    """A process of uid 1234 that binds itself to NPU 1 over the socket: (pid, answer)."""
    pid = ns.spawn(comm=comm, threads=threads, uid=UID)["pid"]
    out = ns.ask_bind(pid=pid, body={"npu": 1})
    assert out["code"] == 200, out
    return pid, out["body"]


def _checks(ns) -> str:
    """What a failed wait for a proof shows: the daemon's log but its status requests, and the
    workers it holds."""
    lines = [line for line in ns.log()["log"].splitlines() if '"path": "/v1/workers"' not in line]
    return "\n".join(lines)[-8000:] + "\nworkers: " + json.dumps(ns.status()["workers"])[:3000]


def proof_of_worker(ns, pid: int) -> dict:
    return next((w["proof"] for w in ns.status()["workers"] if w["pid"] == pid), {})


def test_an_unproven_bind_at_host_moves_nobody_and_a_root_worker_takes_its_npu_over(ns, nobody_prefix):
    ns.daemon(env={"ASCENDBIND_ISOLATION": "host"})
    ns.open_socket()
    everywhere = format_cpulist(STARTED_ON)
    service = ns.spawn(comm="root_service", threads=3)["pid"]
    sleeper = ns.spawn(comm="sleep")["pid"]
    squatter, answer = squat(ns)
    assert answer["proof"]["proven"] is False and answer["proof"]["by"] == "claim", answer["proof"]
    # bound all the same: its own threads have their plan's CPUs
    assert only(ns.masks(pid=squatter)) == {format_cpulist(answer["plan"]["npus"]["1"]["main"])}
    # a second one names no NPU, only the ASCEND_VISIBLE_DEVICES it set itself: a claim too, and
    # bound beside the first (neither is believed, so neither keeps the other out)
    by_env = ns.spawn(comm="env_squatter", threads=1, uid=UID)["pid"]
    out = ns.ask_bind(pid=by_env, body={"env": {"ASCEND_VISIBLE_DEVICES": "1"}})
    assert out["code"] == 200 and out["body"]["npus"] == [1] and out["body"]["replaced"] == [], out
    assert out["body"]["plan"]["targets"]["rule"] == "visible_devices" and not out["body"]["proof"]["proven"]
    iso = ns.iso()
    assert iso["level"] == "host" and not iso["protected"], iso
    # the bind's own follow has run before its answer: root's tasks are where they were, and so is
    # one started after it (nothing is protected, so the watcher moves nothing)
    later = ns.spawn(comm="root_later", threads=1)["pid"]
    for pid in (service, sleeper, later):
        assert only(ns.masks(pid=pid)) == {everywhere}, pid
    assert ns.iso()["tasks"]["moved_as_started"] == 0
    records = ns.status()["workers"]
    assert {w["pid"] for w in records} == {squatter, by_env} and not any(w["proof"]["proven"] for w in records)

    # root's worker on the same NPU is not kept out: the squatter is released, and isolation starts
    worker = ns.spawn(comm="worker", threads=2)["pid"]
    out = ns.curl(method="POST", path="/v1/bind", body={"pid": worker, "npu": 1})
    assert out["code"] == 200, out
    assert sorted(out["body"]["replaced"]) == sorted([squatter, by_env]), out["body"]
    assert out["body"]["proof"]["by"] == "root"
    iso = ns.iso()
    protected = parse_cpulist(iso["protected"])
    assert protected and iso["error"] is None, iso
    rest = format_cpulist(STARTED_ON - protected)
    for pid in (service, sleeper, later, squatter, by_env):  # the squatters are two more tasks now
        assert only(moved(ns, pid, iso["protected"])) == {rest}, pid
    assert [w["pid"] for w in ns.status()["workers"]] == [worker]
    assert '"unproven holder evicted"' in ns.log()["log"]


def test_npu_smi_listing_an_unproven_worker_proves_it_and_it_takes_the_npu_from_a_squatter(ns, nobody_prefix):
    ns.daemon(env={"ASCENDBIND_ISOLATION": "host"}, listed=True)
    ns.open_socket()
    service = ns.spawn(comm="root_service", threads=2)["pid"]
    squatter, _ = squat(ns)
    # a real worker of the same user, bound before it opens its NPU (as ``ascendbind run``'s child
    # binds itself before its exec): nothing proves either, so neither keeps the other out
    real, answer = squat(ns, comm="real_worker")
    assert answer["replaced"] == [] and answer["proof"]["proven"] is False, answer
    assert {w["pid"] for w in ns.status()["workers"]} == {squatter, real}
    assert not ns.iso()["protected"]
    # the check after the answer found it unlisted; npu-smi lists it now, and a later check sees it
    ns.list(items=f"{real}:1")
    assert wait_for(lambda: proof_of_worker(ns, real).get("proven"), 30), _checks(ns)
    assert proof_of_worker(ns, real)["by"] == "npu_check"
    iso = ns.iso()
    assert iso["protected"], iso
    rest = format_cpulist(STARTED_ON - parse_cpulist(iso["protected"]))
    assert only(moved(ns, service, iso["protected"])) == {rest}
    # the squatter was released when the worker was proven, and is moved like any other task
    assert [w["pid"] for w in ns.status()["workers"]] == [real]
    assert only(moved(ns, squatter, iso["protected"])) == {rest}


def test_ascendbind_run_by_root_isolates_from_its_bind_before_the_exec(ns):
    ns.daemon(env={"ASCENDBIND_ISOLATION": "host"})
    service = ns.spawn(comm="root_service", threads=2)["pid"]
    served = ns.run(comm="served", npu=1)["pid"]  # the pid is printed after the exec: bound by then
    assert proof_of_worker(ns, served)["by"] == "root"
    iso = ns.iso()
    assert iso["protected"], iso
    assert only(moved(ns, service, iso["protected"])) == {format_cpulist(STARTED_ON - parse_cpulist(iso["protected"]))}


def test_an_unprivileged_run_isolates_nothing_until_npu_smi_lists_its_worker(ns, nobody_prefix):
    ns.daemon(env={"ASCENDBIND_ISOLATION": "host"}, listed=True)
    ns.open_socket()
    service = ns.spawn(comm="root_service", threads=2)["pid"]
    served = ns.run(comm="served", npu=1, uid=UID)["pid"]
    proof = proof_of_worker(ns, served)
    assert proof["proven"] is False and proof["by"] == "claim", proof
    assert not ns.iso()["protected"] and only(ns.masks(pid=service)) == {format_cpulist(STARTED_ON)}
    # the worker opens its NPU: npu-smi lists it, a re-check proves it, isolation starts
    ns.list(items=f"{served}:1")
    assert wait_for(lambda: proof_of_worker(ns, served).get("by") == "npu_check", 30), _checks(ns)
    iso = ns.iso()
    assert only(moved(ns, service, iso["protected"])) == {format_cpulist(STARTED_ON - parse_cpulist(iso["protected"]))}


# ---------------------------------------------------------------- irqs, on this machine's IRQs


@contextlib.contextmanager
def _bound_as_user(sock: str, role: str, threads: str, npu: int) -> Iterator[tuple[int, dict]]:
    """A process of uid ``UID`` (CHILD's ``role`` with ``threads`` threads) that binds itself
    to ``npu`` over ``sock``: (its pid, the daemon's answer); killed and reaped afterwards."""
    p = subprocess.Popen([*as_user(UID), sys.executable, "-c", CHILD, role, threads, CHILD],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        p.stdin.write(f'bind {sock} {{"npu": {npu}}}\n')
        p.stdin.flush()
        yield pid, json.loads(p.stdout.readline())
    finally:
        p.kill()
        p.wait(10)


def test_an_unproven_bind_at_irqs_moves_no_irq_and_root_binding_the_same_worker_does(masks, nobody_prefix):  # noqa: F811
    with daemon(ASCENDBIND_ISOLATION="irqs") as d:
        os.chmod(d.dir, 0o755)
        os.chmod(d.sock, 0o666)
        with _bound_as_user(d.sock, "squatter", "1", 1) as (pid, out):
            assert out["code"] == 200 and out["body"]["proof"]["proven"] is False, out
            assert not isolation(d)["protected"]
            assert changed(masks) == {}, "an unproven bind moved host masks"
            # root binds the same worker: proven by root's word, isolation follows
            status, body = d.curl("POST", "/v1/bind", {"pid": pid, "npu": 1})
            assert status == 200 and body["proof"]["by"] == "root", body
            assert_off_the_protected_cpus(isolation(d))
            assert {k for k in changed(masks) if k.startswith("irq:")}
            status, _ = d.curl("POST", "/v1/release", {"pid": pid})
            assert status == 200
            assert changed(masks) == {}


# ---------------------------------------------------------------- the NPU's own IRQs, on this machine's IRQs


def _listing_irq_daemon(directory: Path, sys_root: Path, interrupts: Path, listed: Path) -> DaemonProc:
    """A daemon whose NPU 0 owns two real IRQs of this machine (its /proc/interrupts, in a mount
    namespace of its own, and its sys tree name them as the NPU driver does) and whose npu-smi
    lists the pids ``listed`` holds (``PID:NPU`` items)."""
    wrapper = directory / "npu-smi"
    wrapper.write_text(f"#!{sys.executable}\nimport os, sys\nwith open({str(listed)!r}) as fh:\n"
                       "    os.environ['ASCENDBIND_FAKE_NPU_PIDS'] = ','.join(fh.read().split())\n"
                       f"os.execv(sys.executable, [sys.executable, {str(FIXTURE_BIN / 'npu-smi')!r}, *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    env = base_env(str(directory / "ascendbind.sock"), str(directory / "state"), free_port(),
                   ASCENDBIND_SYS_ROOT=str(sys_root), ASCENDBIND_NPU_SMI=str(wrapper),
                   ASCENDBIND_IRQBALANCE="warn")  # never tell an irqbalance some other test runs
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /proc/interrupts && exec "$@"', str(interrupts),
            sys.executable, "-m", "ascendbind.cli", "serve"]
    return DaemonProc(str(directory), env, argv)


def _irq_step(d: DaemonProc, pid: int) -> dict:
    worker = next((w for w in d.client.workers()["workers"] if w["pid"] == pid), {})
    return next((s for s in worker.get("steps", ()) if s["step"] == "irq"), {})


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/proc/irq", os.W_OK), reason="needs root and /proc/irq")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_an_unproven_bind_moves_no_irq_of_its_npu_until_npu_smi_lists_it_and_release_puts_them_back(
        masks, nobody_prefix):  # noqa: F811
    sq, cq = _changeable_irqs(2)
    directory = Path(tempfile.mkdtemp(prefix="ascendbind-irqproof-", dir="/tmp"))
    try:
        sys_root, interrupts = _npu_host(directory, sq, cq)
        listed = directory / "listed"
        listed.write_text("")
        d = _listing_irq_daemon(directory, sys_root, interrupts, listed)
        d.start()
        try:
            d.wait_discovered()
            _unproven_then_proven(d, directory, listed, masks, sq, cq)
        finally:
            d.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _unproven_then_proven(d: DaemonProc, directory: Path, listed: Path, masks: dict, sq: int, cq: int) -> None:
    os.chmod(directory, 0o755)
    os.chmod(d.sock, 0o666)
    with _bound_as_user(d.sock, "npu_worker", "2", 0) as (pid, out):
        assert out["code"] == 200 and out["body"]["proof"]["proven"] is False, out
        [irq] = [s for s in out["body"]["steps"] if s["step"] == "irq"]
        assert (irq["outcome"], irq["reason"]) == ("skipped", "unproven"), irq
        assert changed(masks) == {}, "an unproven bind moved host masks"
        irq_cpus = frozenset(out["body"]["plan"]["npus"]["0"]["irq"])
        # IRQs already on the plan's IRQ CPUs could not show a move: start them elsewhere
        for n in (sq, cq):
            if parse_mask(read_irq_mask(n)) == irq_cpus:
                assert set_irq_affinity(n, frozenset(os.sched_getaffinity(0)) - irq_cpus or
                                        frozenset(os.sched_getaffinity(0))).status == "ok"
        before = {n: read_irq_mask(n) for n in (sq, cq)}
        # the worker opens its NPU: npu-smi lists it, a re-check proves it, and its IRQs follow
        (directory / "listed.new").write_text(f"{pid}:0")
        os.replace(directory / "listed.new", listed)
        moved = lambda: {n: parse_mask(read_irq_mask(n)) for n in (sq, cq)} == {sq: irq_cpus, cq: irq_cpus}  # noqa: E731
        assert wait_for(moved, 30 * PATIENCE), d.log()[-4000:]
        assert wait_for(lambda: _irq_step(d, pid).get("outcome") == "applied", 10 * PATIENCE), _irq_step(d, pid)
        [w] = [w for w in d.client.workers()["workers"] if w["pid"] == pid]
        assert w["proof"]["by"] == "npu_check", w["proof"]
        state = json.loads((directory / "state" / "state.json").read_text())
        [rec] = [r for r in state["workers"] if r["pid"] == pid]
        assert rec["saved_irq_masks"] == {str(n): m for n, m in before.items()} and not rec.get("in_flight"), rec
        status, _ = d.curl("POST", "/v1/release", {"pid": pid})
        assert status == 200
        assert {n: read_irq_mask(n) for n in (sq, cq)} == before  # byte for byte
