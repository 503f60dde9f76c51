"""The state record: typed values round-trip through the file, the record is small
(cpu lists as strings, no plan copy), and a file the previous version wrote loads."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from ascendbind.applier import apply_plan, release_binding
from ascendbind.values.config import Config
from ascendbind.daemon.state.staterecord import binding_from_json, binding_to_json
from ascendbind.values.reasons import Outcome, Reason, Step
from ascendbind.values.frozen import frozen_map
from ascendbind.values.decisions import IrqBinding
from ascendbind.settings import load_config
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.watch.held import Held
from ascendbind.daemon.state.state import STATE_VERSION, StateFile, encode_record
from ascendbind.discovery import SnapshotHost, discover_host, discover_worker
from ascendbind.values.model import Binding, IrqbalanceBans, Mode, NpuPlan, StepResult
from ascendbind.planner import make_plan
from tests.builders import proc_daemon
from tests.golden import HOSTS, ROOT
from tests.test_applier_bind import CONFIG, CPUS, host_facts, plan_for, worker_facts
from tests.workers import cpus_allowed_of, start_worker

V1_FIXTURE = os.path.join(ROOT, "fixtures", "state", "state-v1.json")
HELD = {"bound_at": 12.5, "topology_policy": "best-effort", "culprit": "self", "blame": "torch_npu set it",
        "left_alone": True, "left_alone_why": "moved again", "irq_culprit": "irqbalance", "irqs_left_alone": False,
        "irqs_left_alone_why": None}


def _a2_binding() -> Binding:
    src = SnapshotHost(os.path.join(HOSTS, "a2-8x910b3"))
    host = discover_host(src, Config())
    plan = make_plan(host, discover_worker(src, 4242, Config()), (3, 5), Config())
    assert plan.alignment is not None and plan.alignment.providers  # the planner's hints are there
    irqs = (IrqBinding(3, 211, frozenset({120}), "ffffffff,ffffffff", "ok", "00000000,00000001"),
            IrqBinding(3, 212, frozenset({121}), "ffffffff,ffffffff", "failed", "ffffffff,fffffffe", "wrote x"),
            IrqBinding(5, 163, frozenset({48}), "0000ffff", "unchangeable", "0000ffff", "Input/output error"))
    steps = (StepResult(Step.AFFINITY, Outcome.APPLIED, None, "8 threads bound", frozen_map({"bound": 8})),
             StepResult(Step.IRQ, Outcome.FAILED, Reason.IRQ_WRITE_FAILED, "IRQ 212: wrote x",
                        frozen_map({"npus": [{"npu": 3}], "previous": {211: "ffffffff,ffffffff"}})),
             StepResult(Step.UVB, Outcome.APPLIED, None, "2 uvb_poll_window_thread -> 16-39"))
    return Binding(4242, 987654, (3, 5), plan, frozenset(range(192)),
                   frozen_map({211: "ffffffff,ffffffff", 212: "ffffffff,ffffffff"}), steps,
                   IrqbalanceBans(777, 4000, frozenset({211, 212})), irqs,
                   frozen_map({1890: frozenset({0, 1, 2, 3}), 1891: frozenset(range(192))}))


def _as_kept(b: Binding) -> Binding:
    """What the file keeps of ``b``: everything but the alignment hints and the steps' report data."""
    plan = dataclasses.replace(b.plan, alignment=b.plan.alignment.without_hints())
    return dataclasses.replace(b, plan=plan, steps=tuple(dataclasses.replace(s, data=frozen_map()) for s in b.steps))


def test_typed_values_round_trip_through_the_state_file(tmp_path):
    b = _a2_binding()
    sf = StateFile(str(tmp_path / "st"))
    sf.save([binding_to_json(b, **HELD)])
    loaded = sf.load()
    assert loaded.moved_aside is None and len(loaded.workers) == 1
    back = binding_from_json(loaded.workers[0])
    assert back == _as_kept(b)
    assert back.irqs[1].changed and not back.irqs[2].changed and back.uvb_previous[1890] == {0, 1, 2, 3}
    assert back.plan.alignment.failure == b.plan.alignment.failure and back.plan.alignment.npus
    assert {k: loaded.workers[0][k] for k in HELD} == HELD
    # the same status answer for clients: the plan JSON differs only by the hints
    shown, kept = b.plan.to_json(), back.plan.to_json()
    assert kept["alignment"]["providers"] == {"device": [], "cpu": [], "memory": []}
    shown["alignment"]["providers"] = kept["alignment"]["providers"]
    assert kept == shown


def test_a_held_workers_record_is_encoded_again_only_when_it_changed(tmp_path):
    b = _a2_binding()
    held = Held(b, 12.5, "best-effort")
    first = held.state_record()
    assert held.state_record() is first  # unchanged: the text of the last save, not a new encoding
    assert json.loads(first) == binding_to_json(b, **held.state_json())
    held.leave_alone("threads", "moved again")  # a verdict the reconcile loop reached
    second = held.state_record()
    assert second is not first and json.loads(second)["left_alone"] is True
    held.binding = dataclasses.replace(b, npus=(3,))  # a new binding (a re-plan)
    assert json.loads(held.state_record())["npus"] == [3]


def test_saving_encoded_records_writes_the_file_save_writes(tmp_path):
    b = _a2_binding()
    records = [binding_to_json(b, **HELD), binding_to_json(dataclasses.replace(b, pid=4243), **HELD)]
    by_dicts, by_texts = StateFile(str(tmp_path / "a")), StateFile(str(tmp_path / "b"))
    by_dicts.save(records)
    by_texts.save_encoded([encode_record(r) for r in records])
    docs = [json.load(open(sf.path)) for sf in (by_dicts, by_texts)]
    for doc in docs:
        doc.pop("written_at")
    assert docs[0] == docs[1]  # the checksum included
    assert [w["pid"] for w in by_texts.load().workers] == [4242, 4243]


def test_the_record_holds_cpu_lists_as_strings_and_no_plan_copy():
    rec = json.loads(json.dumps(binding_to_json(_a2_binding())))
    assert rec["original_cpus"] == "0-191"
    assert rec["plan"]["allowed"] == "0-191" and "allowed_cpus" not in rec["plan"]
    assert rec["plan"]["npus"]["3"] == {"pool": "120-143", "irq": "120-121", "main": "122-141", "acl": "142",
                                        "release": "143", "numa_nodes": "5"}
    assert "providers" not in rec["plan"]["alignment"]
    assert all("data" not in s for s in rec["steps"])
    assert rec["irqs"][0] == {"npu": 3, "irq": 211, "cpus": "120", "previous": "ffffffff,ffffffff", "status": "ok",
                              "now": "00000000,00000001"}
    assert rec["uvb_previous"] == {"1890": "0-3", "1891": "0-191"}


def _v1_in(tmp_path) -> tuple[StateFile, dict, str]:
    """The fixture v1 file as state.json of a state dir, and a proc root of the same boot."""
    with open(V1_FIXTURE) as fh:
        doc = json.load(fh)
    proc = tmp_path / "proc"
    (proc / "sys/kernel/random").mkdir(parents=True)
    (proc / "sys/kernel/random/boot_id").write_text(doc["boot_id"] + "\n")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    shutil.copy(V1_FIXTURE, state / "state.json")
    os.chmod(state / "state.json", 0o600)
    return StateFile(str(state), proc_root=str(proc)), doc, str(proc)


def test_a_version_1_file_loads_with_its_irq_writes_as_typed_values(tmp_path):
    sf, doc, _ = _v1_in(tmp_path)
    assert doc["version"] == 1 and STATE_VERSION == 2
    loaded = sf.load()
    assert loaded.moved_aside is None and loaded.problem is None and len(loaded.workers) == 1
    b = binding_from_json(loaded.workers[0])
    old = doc["workers"][0]
    irq_step = next(s for s in old["steps"] if s["step"] == "irq")
    writes = [(e["npu"], w) for e in irq_step["data"]["npus"] for w in e.get("writes", ())]
    assert writes  # the fixture holds IRQ writes
    assert [(i.npu, i.irq, sorted(i.cpus), i.previous, i.status) for i in b.irqs] == \
        [(n, w["irq"], w["cpus"], w["previous"], w["status"]) for n, w in writes]
    assert dict(b.saved_irq_masks) == {int(k): v for k, v in old["saved_irq_masks"].items()}
    assert b.irqbalance_bans == IrqbalanceBans.from_json(old["irqbalance_bans"])
    assert b.original_cpus == frozenset(old["original_cpus"]) and b.npus == tuple(old["npus"])
    assert b.plan.alignment is not None and b.plan.alignment.policy == old["plan"]["alignment"]["policy"]
    assert [p.pool for p in b.plan.npus] == [tuple(v["pool"]) for v in old["plan"]["npus"].values()]
    assert {k: loaded.workers[0][k] for k in HELD} == {k: old[k] for k in HELD}


def test_a_daemon_restarted_over_a_version_1_file_restores_a_gone_workers_irq_masks(tmp_path):
    sf, doc, proc = _v1_in(tmp_path)
    old = doc["workers"][0]
    for irq in old["saved_irq_masks"]:  # the masks as the old daemon left them
        (tmp_path / "proc" / "irq" / irq).mkdir(parents=True)
        (tmp_path / "proc" / "irq" / irq / "smp_affinity").write_text("00000001\n")
    config = load_config(None, env={}).replace(proc_root=proc, state_dir=sf.dir)
    d = Daemon(config)
    d.state.prepare()
    assert d.restore() == {"kept": 0, "gone": 1, "other_boot": 0, "malformed": 0}  # pid 4242 is not in proc
    for irq, mask in old["saved_irq_masks"].items():
        assert (tmp_path / "proc" / "irq" / irq / "smp_affinity").read_text().strip() == mask
    with open(sf.path) as fh:
        assert json.load(fh)["version"] == STATE_VERSION  # written back in the current format


def test_a_torn_file_is_moved_aside(tmp_path):
    # what a power loss can leave without fsync: the next boot finds part of the file
    sf = StateFile(str(tmp_path / "st"))
    sf.save([binding_to_json(_a2_binding(), **HELD)])
    with open(sf.path, "rb") as fh:
        whole = fh.read()
    with open(sf.path, "wb") as fh:
        fh.write(whole[: len(whole) // 2])
    loaded = sf.load()
    assert loaded.workers == [] and loaded.moved_aside and "corrupt" in loaded.problem
    assert not os.path.exists(sf.path)


def test_a_restored_950_binding_still_puts_the_uvb_threads_back(tmp_path):
    """The UVB threads' masks before binding live in ``Binding.uvb_previous``; a daemon
    restarted in between restores them from the state file alone."""
    pool = tuple(CPUS)
    npu_plan = NpuPlan(0, pool, (), pool, (), (), (0,))
    with start_worker(plain=0, acl=0, release=0, names=("uvb_poll_window_thread",)) as driver, start_worker() as w:
        uvb_tid = next(t for t, c in driver.threads().items() if c.startswith("uvb_poll_window"))
        plan = plan_for(npu_plan, Mode.ASCEND950_CLUSTER, uvb_cpus=(CPUS[-1],), uvb_tids=(uvb_tid,))
        bound = apply_plan(plan, worker_facts(w.pid, w.start_time), host_facts(), CONFIG)
        assert dict(bound.uvb_previous) == {uvb_tid: frozenset(CPUS)}
        assert cpus_allowed_of(driver.pid, uvb_tid) == {CPUS[-1]}
        sf = StateFile(str(tmp_path / "st"))
        sf.save([binding_to_json(bound)])
        restored = binding_from_json(sf.load().workers[0])
        assert restored.uvb_previous == bound.uvb_previous
        steps = {s.step: s for s in release_binding(restored, CONFIG, restore_uvb=True)}
        assert steps[Step.UVB].outcome is Outcome.APPLIED, steps[Step.UVB].detail
        assert cpus_allowed_of(driver.pid, uvb_tid) == frozenset(CPUS)


def test_a_record_with_a_bad_irq_write_is_skipped_as_malformed_not_acted_on(tmp_path):
    rec = binding_to_json(_a2_binding(), **HELD)
    for bad in ({"irq": -1}, {"irq": True}, {"status": "maybe"}, {"previous": 7}, {"cpus": [120]}):
        broken = {**rec, "irqs": [{**rec["irqs"][0], **bad}]}
        try:
            binding_from_json(json.loads(json.dumps(broken)))
        except (KeyError, ValueError, TypeError):
            continue
        raise AssertionError(f"accepted an IRQ write with {bad}")
    # in the daemon: the entry is counted malformed and nothing of it is restored
    proc = tmp_path / "proc"
    (proc / "sys/kernel/random").mkdir(parents=True)
    (proc / "sys/kernel/random/boot_id").write_text("b\n")
    (proc / "irq" / "211").mkdir(parents=True)
    (proc / "irq" / "211" / "smp_affinity").write_text("00000001\n")
    d = proc_daemon(tmp_path, proc)
    d.state.prepare()
    d.state.save([{**rec, "irqs": [{**rec["irqs"][0], "status": "maybe"}]}])
    assert d.restore()["malformed"] == 1 and not d.held
    assert (proc / "irq" / "211" / "smp_affinity").read_text() == "00000001\n"
