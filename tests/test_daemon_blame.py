"""The blame rule (evidence -> culprit), the evidence readers, the comm-cache rule of the
reconcile loop's thread look, and the compact JSON printer: tables of plain values,
plus real threads of a real worker where the rule meets the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ascendbind.daemon.watch.blame import (Evidence, blame_irqs, blame_threads, environ_evidence, first_vllm_setting,
                                           left_alone_sentence, split_cmdline, vllm_setting)
from ascendbind.daemon.watch.evidence import MAX_ANCESTORS, is_arm, read_evidence
from ascendbind.daemon.watch.held import YOUNG_PASSES, SeenThread, accepted
from ascendbind.daemon.api.metrics import CULPRITS, Metrics
from ascendbind.daemon.watch.observe import COMM_SWEEP_PASSES, comm_due, observe_threads
from ascendbind.discovery.read.tasks import thread_count
from ascendbind.render import compact_json
from tests.workers import reap, start_worker

# ---------------------------------------------------------------- the blame rule

BLAME_TABLE = [
    # (evidence, culprit, words the sentence must carry)
    (Evidence(), "external", "no sign that the worker binds itself"),
    (Evidence(torch_npu="1"), "self", "CPU_AFFINITY_CONF=1"),
    (Evidence(torch_npu="2,npu0:0-5", arm=False), "self", "torch_npu binds"),
    (Evidence(vllm="on", vllm_pid=42), "self", "pid 42's command line sets enable_cpu_binding"),
    (Evidence(vllm="default", vllm_pid=42), "self", "on by default on ARM hosts since v0.18.0rc1"),
    (Evidence(vllm="off", vllm_pid=42), "external", "vllm-ascend's binder is off on pid 42's command line"),
    (Evidence(vllm="on", vllm_pid=42, arm=False), "external", "runs only on ARM hosts"),
    (Evidence(vllm="default", arm=False), "external", "runs only on ARM hosts"),
    (Evidence(openmp=("OMP_PROC_BIND=true",)), "env", "OMP_PROC_BIND=true"),
    (Evidence(vllm="off", openmp=("GOMP_CPU_AFFINITY=0-3",)), "env", "GOMP_CPU_AFFINITY=0-3"),
    # the worker's own binder outranks OpenMP variables: it is what fights back first
    (Evidence(torch_npu="1", openmp=("KMP_AFFINITY=compact",)), "self", "CPU_AFFINITY_CONF=1"),
]


@pytest.mark.parametrize("evidence,culprit,words", BLAME_TABLE)
def test_blame_rule_names_self_only_on_evidence(evidence, culprit, words):
    b = blame_threads(evidence)
    assert b.culprit == culprit and b.culprit in CULPRITS
    assert words in b.why


def test_irq_blame_is_irqbalance_only_while_it_runs():
    assert blame_irqs(True).culprit == "irqbalance"
    assert blame_irqs(False).culprit == "external" and "irqbalance does not run" in blame_irqs(False).why


@pytest.mark.parametrize("culprit", ["self", "env", "external", "irqbalance"])
def test_left_alone_sentence_says_count_window_blame_and_fix(culprit):
    b = blame_threads(Evidence(torch_npu="1")) if culprit == "self" else \
        blame_threads(Evidence(openmp=("OMP_PROC_BIND=true",))) if culprit == "env" else \
        blame_irqs(True) if culprit == "irqbalance" else blame_threads(Evidence())
    text = left_alone_sentence("thread masks", b, 3, 60.0)
    assert text.startswith("thread masks moved again after 3 re-asserts within 60 s")
    assert f"blamed {culprit}: {b.why}" in text and "Fix: " in text


def test_drift_metric_labels_are_the_fixed_culprit_set():
    m = Metrics()
    m.drifted("self")
    m.drifted("a pid or free text")  # never a new series
    text = m.render().decode()
    labels = sorted(line.split('culprit="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("ascendbind_drift_total{"))
    assert labels == sorted(CULPRITS) and "unknown" not in labels
    assert 'ascendbind_drift_total{culprit="external"} 1.0' in text
    assert 'ascendbind_drift_total{culprit="self"} 1.0' in text


# ---------------------------------------------------------------- evidence parsers

ENV_TABLE = [
    ({}, None, ()),
    ({"CPU_AFFINITY_CONF": "0"}, None, ()),  # mode 0: torch_npu does not bind
    ({"CPU_AFFINITY_CONF": "1"}, "1", ()),
    ({"CPU_AFFINITY_CONF": "2"}, "2", ()),
    ({"CPU_AFFINITY_CONF": "1,npu0:0-1,npu1:2-5"}, "1,npu0:0-1,npu1:2-5", ()),
    ({"CPU_AFFINITY_CONF": "mode:1,npu0:0-3"}, "mode:1,npu0:0-3", ()),
    ({"CPU_AFFINITY_CONF": "0,npu0:0-1"}, None, ()),
    ({"OMP_PROC_BIND": "false"}, None, ()),  # vllm-ascend's own examples export this
    ({"OMP_PROC_BIND": "TRUE"}, None, ("OMP_PROC_BIND=TRUE",)),
    ({"KMP_AFFINITY": "disabled", "GOMP_CPU_AFFINITY": "0-3"}, None, ("GOMP_CPU_AFFINITY=0-3",)),
    ({"KMP_AFFINITY": "granularity=fine,compact"}, None, ("KMP_AFFINITY=granularity=fine,compact",)),
    ({"OMP_PROC_BIND": ""}, None, ()),
]


@pytest.mark.parametrize("env,torch_npu,openmp", ENV_TABLE)
def test_environment_evidence(env, torch_npu, openmp):
    assert environ_evidence(env) == (torch_npu, openmp)


VLLM_TABLE = [
    (["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "Qwen/Qwen2.5-7B"], "default"),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], "default"),
    (["vllm", "serve", "m", "--additional-config", '{"enable_cpu_binding": false}'], "off"),
    (["vllm", "serve", "m", "--additional-config", '{"enable_cpu_binding": true}'], "on"),
    (["vllm", "serve", "m", '--additional-config={"enable_cpu_binding":false,"x":1}'], "off"),
    (["vllm", "serve", "m", "--additional_config", '{"enable_cpu_binding": "False"}'], "off"),
    (["vllm", "serve", "m", "--additional-config", '{"enable_graph_mode": "True"}'], "default"),
    (["vllm", "serve", "m", "--additional-config", "not json"], "default"),
    (["vllm", "serve", "m", "--additional-config", "[" * 100000], "default"),  # deep nesting: no crash
    (["vllm", "serve", "m", "--additional-config"], "default"),  # flag without value
    (["vllm", "serve", "m", "--numa-bind"], "on"),
    # argparse semantics: the last word wins
    (["vllm", "serve", "m", "--numa-bind", "--additional-config", '{"enable_cpu_binding": false}'], "off"),
    (["vllm", "serve", "m", "--additional-config.enable_cpu_binding", "false"], "off"),
    (["vllm", "serve", "m", "--additional-config.enable_cpu_binding=true"], "on"),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()", "--multiprocessing-fork"], None),
    (["python", "train.py", "--model", "vllm"], None),  # "vllm" as a value past the head is no vLLM
    ([], None),
]


@pytest.mark.parametrize("argv,setting", VLLM_TABLE)
def test_vllm_binder_setting_from_a_command_line(argv, setting):
    assert vllm_setting(argv) == setting


def test_nearest_process_with_a_setting_wins():
    lineage = [(300, ["python", "-c", "spawn_main()"]),
               (200, ["python", "-c", "engine core"]),
               (100, ["vllm", "serve", "m", "--additional-config", '{"enable_cpu_binding": false}'])]
    assert first_vllm_setting(lineage) == ("off", 100)
    assert first_vllm_setting(lineage[:2]) == (None, None)
    assert split_cmdline(b"vllm\0serve\0m\0") == ["vllm", "serve", "m"] and split_cmdline(b"") == []


@pytest.mark.parametrize("machine,arm", [("aarch64", True), ("arm64", True), ("armv8l", True),
                                         ("x86_64", False), ("", False)])
def test_arm_hosts(machine, arm):
    assert is_arm(machine) is arm


_CHILD = r"""
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, CPU_AFFINITY_CONF="2"))
child.stdout.readline()
sys.stdout.write(f"{child.pid}\n"); sys.stdout.flush()
sys.stdin.read()
child.stdin.close(); child.wait()
"""


def test_evidence_is_read_from_the_worker_and_its_ancestors_in_proc():
    # a vLLM-like server (the setting on its command line) whose worker has a bare command line
    server = subprocess.Popen([sys.executable, "-c", _CHILD, "vllm", "serve", "m", "--additional-config",
                               '{"enable_cpu_binding": true}'], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={k: v for k, v in os.environ.items() if k != "CPU_AFFINITY_CONF"})
    try:
        worker = int(server.stdout.readline())
        ev = read_evidence(worker, machine="aarch64")
        assert ev.torch_npu == "2" and ev.vllm == "on" and ev.vllm_pid == server.pid and ev.arm
        on_server = read_evidence(server.pid, machine="x86_64")
        assert on_server.torch_npu is None and on_server.vllm == "on" and not on_server.arm
        assert blame_threads(on_server).culprit == "external"
        # a pid that is gone gives no evidence, never an error
        assert read_evidence(2 ** 22 + 12345) == Evidence(arm=is_arm())
        assert MAX_ANCESTORS >= 2  # API server -> engine core -> worker
    finally:
        server.stdin.close()  # it ends its child and exits
        server.wait(timeout=30)
        reap(server)


# ---------------------------------------------------------------- the comm-cache rule

COMM_TABLE = [
    # (tid, seen, pass, due)
    (100, None, 7, True),  # never seen: its name decides its role
    (100, SeenThread(frozenset({0}), "main", young=2), 7, True),  # young: may not be named yet
    (100, SeenThread(frozenset({0}), "main", young=0), 7, False),  # known and old: mask only
    (100, SeenThread(frozenset({0}), "acl", young=0), 7, False),
    (100, SeenThread(frozenset({0}), "main", young=0), COMM_SWEEP_PASSES - 100 % COMM_SWEEP_PASSES, True),  # its slot
]


@pytest.mark.parametrize("tid,seen,pass_no,due", COMM_TABLE)
def test_comm_is_read_only_when_it_can_have_news(tid, seen, pass_no, due):
    assert comm_due(tid, seen, pass_no) is due


def test_the_sweep_reads_every_old_thread_once_per_period_and_spreads_them():
    old = SeenThread(frozenset({0}), "main", young=0)
    tids = range(5000, 5200)
    per_pass = [sum(comm_due(t, old, p) for t in tids) for p in range(COMM_SWEEP_PASSES)]
    assert all(sum(comm_due(t, old, p) for p in range(COMM_SWEEP_PASSES)) == 1 for t in tids)
    assert max(per_pass) - min(per_pass) <= 1  # no pass pays for a whole sweep


@pytest.mark.parametrize("read_back,wanted,held", [
    ({2, 3}, {2, 3}, {2, 3}),  # what we set
    ({3}, {2, 3}, {3}),  # a cpuset narrowed it: the kernel's answer is the binding
    ({0, 1, 2, 3}, {2, 3}, {2, 3}),  # an in-process binder undid it before the read: not ours to keep
    ({7}, {2, 3}, {2, 3}),
    (set(), {2, 3}, {2, 3}),
])
def test_the_mask_held_after_a_write_is_ours_or_the_kernels_narrowing_of_it(read_back, wanted, held):
    assert accepted(read_back, frozenset(wanted)) == frozenset(held)


def _split_roles() -> dict[str, frozenset[int]]:
    """main on every CPU but the last; acl and release on the last."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"main": frozenset(cpus[:-1]), "acl": frozenset(cpus[-1:]), "release": frozenset(cpus[-1:])}


def _all_on(w, cpus: frozenset[int]) -> None:
    for tid in list(w.threads()):
        os.sched_setaffinity(tid, cpus)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="roles only separate with 2+ CPUs")
def test_a_real_thread_renamed_after_its_young_passes_is_caught_in_its_sweep_slot():
    roles = _split_roles()
    with start_worker(plain=1, acl=0, release=0) as w:
        _all_on(w, roles["main"])
        cache: dict[int, SeenThread] = {}
        pass_no = 1
        assert observe_threads(w.pid, cache, roles, pass_no) == ([], [])  # all on main: accepted
        late = w.spawn("worker_late")  # born on main, named as a main thread
        pass_no += 1
        assert observe_threads(w.pid, cache, roles, pass_no) == ([], [])
        assert cache[late].role == "main" and cache[late].young == YOUNG_PASSES
        for _ in range(YOUNG_PASSES):  # its young passes end
            pass_no += 1
            observe_threads(w.pid, cache, roles, pass_no)
        assert cache[late].young == 0
        w.rename(late, "acl_thread_9")
        slot = next(p for p in range(pass_no + 1, pass_no + 1 + COMM_SWEEP_PASSES)
                    if (late + p) % COMM_SWEEP_PASSES == 0)
        for p in range(pass_no + 1, slot):  # not its slot: comm is not read, the rename is not seen
            assert observe_threads(w.pid, cache, roles, p) == ([], [])
        assert observe_threads(w.pid, cache, roles, slot) == ([(late, "acl")], [])
        # a thread that exits is forgotten, so its tid is a new thread if the kernel hands it out again
        w.stop(late)
        observe_threads(w.pid, cache, roles, slot + 1)
        assert late not in cache and set(cache) == set(w.threads())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="roles only separate with 2+ CPUs")
def test_a_real_thread_named_after_the_look_that_first_saw_it_is_caught_while_young():
    roles = _split_roles()
    with start_worker(plain=1, acl=0, release=0) as w:
        _all_on(w, roles["main"])
        cache: dict[int, SeenThread] = {}
        pass_no = 7
        observe_threads(w.pid, cache, roles, pass_no)
        late = w.spawn("worker_late")
        pass_no += 1
        observe_threads(w.pid, cache, roles, pass_no)  # seen as main, not yet named
        w.rename(late, "acl_thread")
        pass_no += 1
        while (late + pass_no) % COMM_SWEEP_PASSES == 0:  # prove the young rule, not the sweep
            pass_no += 1
        assert observe_threads(w.pid, cache, roles, pass_no) == ([(late, "acl")], [])
        # a mask someone else changed is drift; the look reads the kernel, never the cache
        other = next(t for t in w.threads() if t != late)
        os.sched_setaffinity(other, os.sched_getaffinity(0))
        assert observe_threads(w.pid, cache, roles, pass_no + 1)[1] == [other]
    assert observe_threads(w.pid, cache, roles, pass_no + 2) is None  # reaped: no task list


def _fake_task_dir(task, num_threads: int) -> None:
    """A task directory whose link count says ``num_threads`` (each subdirectory adds a
    link) but which lists no thread: the entries are not thread ids."""
    for entry in task.iterdir():
        entry.rmdir()
    for i in range(num_threads):
        (task / f"not-a-tid-{i}").mkdir()


def test_a_look_walks_the_cache_without_listing_while_the_thread_count_holds(tmp_path):
    with start_worker(plain=2, acl=0, release=0) as w:
        assert thread_count(w.pid) == len(w.threads())
        cpus = frozenset(os.sched_getaffinity(0))
        roles = {"main": cpus, "acl": cpus, "release": cpus}
        for tid in w.threads():
            os.sched_setaffinity(tid, cpus)
        cache: dict[int, SeenThread] = {}
        observe_threads(w.pid, cache, roles, 1)
        for seen in cache.values():
            seen.young = 0
        # a proc tree whose task directory counts the real threads but lists none: a look
        # that listed would forget every thread; the walk answers from the kernel's masks
        fake = tmp_path / "proc"
        (fake / str(w.pid) / "task").mkdir(parents=True)
        _fake_task_dir(fake / str(w.pid) / "task", len(cache))
        quiet = next(p for p in range(2, 2 + COMM_SWEEP_PASSES)
                     if all((t + p) % COMM_SWEEP_PASSES for t in cache))
        assert observe_threads(w.pid, cache, roles, quiet, proc_root=str(fake)) == ([], [])
        assert set(cache) == set(w.threads())
        # one more thread than cached: the listing decides (and, being empty here, forgets all)
        _fake_task_dir(fake / str(w.pid) / "task", len(cache) + 1)
        assert observe_threads(w.pid, cache, roles, quiet, proc_root=str(fake)) == ([], [])
        assert cache == {}


def test_a_thread_born_as_another_exits_keeps_the_count_and_is_still_found():
    every = frozenset(os.sched_getaffinity(0))
    roles = {"main": every, "acl": every, "release": every}
    with start_worker(plain=1, acl=0, release=0) as w:
        _all_on(w, roles["main"])
        old = w.spawn("worker_old")
        cache: dict[int, SeenThread] = {}
        observe_threads(w.pid, cache, roles, 1)
        w.stop(old)
        new = w.spawn("acl_thread")  # same count as the cache holds
        assert thread_count(w.pid) == len(cache)
        to_pin, drifted = observe_threads(w.pid, cache, roles, 2)
        # the walk met the exited tid (ESRCH), listed, forgot it and found the newcomer
        assert old not in cache and new in cache and drifted == []
        assert set(cache) == set(w.threads()) and cache[new].role == "acl"
        assert to_pin == []  # its role's CPUs are the whole set here: already where it belongs


# ---------------------------------------------------------------- compact JSON


@pytest.mark.parametrize("obj", [
    {}, [], {"a": []}, {"a": {}}, 1, "x", None,
    {"allowed_cpus": list(range(192)), "npus": {"3": {"pool": list(range(120, 144)), "acl": [142]}}},
    {"k": [{"npu": 3, "numa_nodes": [4], "preferred": True, "score": 0}] * 9, "s": "é\u2603\"\\"},
    [[1, 2], [3, [4, [5, list(range(60))]]]],
    {1: "int key", 2.5: "float key", None: "null key", False: "bool key"},
])
def test_compact_json_reads_back_as_plain_json(obj):
    text = compact_json(obj)
    assert json.loads(text) == json.loads(json.dumps(obj))
    assert all(len(line) <= 101 for line in text.splitlines() if '"' not in line)  # packed number lines


def test_compact_json_keeps_short_values_on_one_line_and_packs_long_lists():
    text = compact_json({"irq": [120, 121], "main": list(range(200))})
    lines = text.splitlines()
    assert '  "irq": [120, 121],' in lines
    assert len(lines) <= 15 and "    0, 1, 2, 3" in text  # 200 numbers on 11 lines, not 200


def test_verdicts_survive_the_state_file_and_an_old_unknown_reads_as_external():
    from ascendbind.daemon.watch.held import Held
    from tests.builders import irq_binding

    b = irq_binding(4242, 0, 120, 121)
    h = Held(b, 1.0)
    threads, irqs = h.drift["threads"], h.drift["irqs"]
    threads.culprit, threads.blame, threads.left_alone, threads.why = "self", "CPU_AFFINITY_CONF=1 ...", True, \
        "moved again ..."
    irqs.culprit, irqs.left_alone, irqs.why = "irqbalance", True, "IRQ masks moved again ..."
    back = Held.from_state(b, json.loads(json.dumps(h.state_json())), 9.0)
    assert back.state_json() == h.state_json()
    old = Held.from_state(b, {"culprit": "unknown", "left_alone": True, "blame": ["not", "text"]}, 9.0)
    assert old.drift["threads"].culprit == "external" and old.drift["threads"].left_alone
    assert old.drift["threads"].blame is None and old.bound_at == 9.0
