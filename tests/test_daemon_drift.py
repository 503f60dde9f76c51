"""Drift blame, late renamed threads and the explainable status, against a real
``ascendbind serve`` and real workers: taskset moves a bound thread, a worker
rebinds itself with torch_npu's CPU_AFFINITY_CONF in its environment, a
vLLM-like server's worker rebinds itself, a thread renames itself into the ACL
role, and an operator reads ``ascendbind status`` (with ``--explain``).

One daemon serves the module (fake one-NPU host, reconcile every second,
small_pool = share); every test reaps its own processes and releases its
bindings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from ascendbind.values.cpulist import format_mask, parse_cpulist
from ascendbind.daemon.watch.evidence import is_arm
from ascendbind.daemon.watch.held import YOUNG_PASSES
from tests.daemon_harness import ROOT, DaemonProc, metric_value, running_daemon, wait_for
from tests.workers import SELF_BINDER, cpus_allowed_of, reap, start_worker

N_CPUS = len(os.sched_getaffinity(0))
ALL = frozenset(os.sched_getaffinity(0))
pytestmark = [pytest.mark.skipif(N_CPUS < 2, reason="roles and drift only show with 2+ CPUs"),
              pytest.mark.usefixtures("daemon_survives")]  # each test leaves the shared daemon as it found it
BINDER_ENV = ("CPU_AFFINITY_CONF", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")


@pytest.fixture(scope="module")
def daemon():
    directory = tempfile.mkdtemp(prefix="ascendbind-drift-", dir="/tmp")
    try:
        with running_daemon(directory) as d:
            d.wait_discovered()
            yield d
    finally:
        shutil.rmtree(directory, ignore_errors=True)




def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in BINDER_ENV}
    env.update(extra)
    return env


def drift_of(daemon, pid: int) -> dict:
    return daemon.client.worker(pid)["drift"]


def status_cli(daemon, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ascendbind", "status", "--socket", daemon.sock, *argv],
                          capture_output=True, text=True, env=daemon.env, cwd=str(ROOT), timeout=60)


def passes(daemon) -> float:
    return metric_value(daemon.metrics_text(), "ascendbind_reconcile_runs_total") or 0


# ---------------------------------------------------------------- blame


def test_a_bound_thread_moved_by_taskset_is_blamed_external_and_never_self(daemon):
    taskset = shutil.which("taskset")
    assert taskset, "util-linux taskset is needed"
    self_before = metric_value(daemon.metrics_text(), "ascendbind_drift_total", culprit="self") or 0
    with start_worker(plain=1, acl=0, release=0) as w:
        body = daemon.client.bind(w.pid, 0)
        main = frozenset(body["plan"]["npus"]["0"]["main"])
        tid = w.tid_named("worker_0")
        for moved in (1, 2, 3):
            subprocess.run([taskset, "-p", format_mask(ALL), str(tid)], check=True, capture_output=True)
            assert wait_for(lambda: cpus_allowed_of(w.pid, tid) == main, 10), daemon.log()[-3000:]
            drift = drift_of(daemon, w.pid)
            assert drift["events"] == moved and drift["culprit"] == "external" and not drift["left_alone"]
            assert "no sign that the worker binds itself" in drift["blame"]
        # a fourth move within the window: left alone, whatever the blame, and the status says why
        subprocess.run([taskset, "-p", format_mask(ALL), str(tid)], check=True, capture_output=True)
        assert wait_for(lambda: drift_of(daemon, w.pid)["left_alone"], 10), daemon.log()[-3000:]
        drift = drift_of(daemon, w.pid)
        assert drift["culprit"] == "external" and drift["events"] == 4
        assert "moved again after 3 re-asserts" in drift["left_alone_why"]
        assert cpus_allowed_of(w.pid, tid) == ALL  # no longer fought over
        out = status_cli(daemon)
        assert out.returncode == 0, out.stderr
        assert f"  {w.pid}: threads left alone: thread masks moved again after 3 re-asserts" in out.stdout
        assert "blamed external" in out.stdout
    text = daemon.metrics_text()
    assert (metric_value(text, "ascendbind_drift_total", culprit="self") or 0) == self_before


def test_a_worker_with_cpu_affinity_conf_that_rebinds_itself_is_blamed_self(daemon):
    proc = subprocess.Popen([sys.executable, "-c", SELF_BINDER], stdout=subprocess.PIPE, text=True,
                            env=clean_env(CPU_AFFINITY_CONF="1"))
    try:
        assert proc.stdout.readline().strip() == "ready"
        daemon.client.bind(proc.pid, 0)
        assert wait_for(lambda: drift_of(daemon, proc.pid)["left_alone"], 15), daemon.log()[-3000:]
        drift = drift_of(daemon, proc.pid)
        assert drift["culprit"] == "self" and drift["events"] >= 4
        assert "CPU_AFFINITY_CONF=1" in drift["blame"] and "torch_npu" in drift["blame"]
        assert "blamed self" in drift["left_alone_why"] and "unset CPU_AFFINITY_CONF" in drift["left_alone_why"]
        assert metric_value(daemon.metrics_text(), "ascendbind_drift_total", culprit="self") >= 4
    finally:
        reap(proc)


_VLLM_SERVER = r"""
import os, subprocess, sys
# like vLLM's multiprocessing spawn: the worker's own command line says nothing
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
sys.stdout.write(f"{child.pid}\n"); sys.stdout.flush()
sys.stdin.read()
child.kill(); child.wait()
"""


def test_a_vllm_worker_is_judged_by_its_servers_command_line(daemon):
    server = subprocess.Popen([sys.executable, "-c", _VLLM_SERVER, SELF_BINDER, "vllm", "serve", "m",
                               "--additional-config", '{"enable_cpu_binding": true}'],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        worker = int(server.stdout.readline())
        daemon.client.bind(worker, 0)
        assert wait_for(lambda: drift_of(daemon, worker)["left_alone"], 15), daemon.log()[-3000:]
        drift = drift_of(daemon, worker)
        assert f"pid {server.pid}'s command line" in drift["blame"]  # found on the parent, not the worker
        if is_arm():
            assert drift["culprit"] == "self" and "enable_cpu_binding" in drift["blame"]
        else:  # vllm-ascend's binder skips non-ARM hosts: no evidence against the worker here
            assert drift["culprit"] == "external" and "runs only on ARM hosts" in drift["blame"]
    finally:
        server.stdin.close()  # the server kills its worker when its stdin ends
        server.wait(timeout=30)
        reap(server)


# ---------------------------------------------------------------- late names


def test_a_thread_that_names_itself_acl_thread_after_the_loop_saw_it_is_still_pinned(daemon):
    with start_worker(plain=1, acl=0, release=0) as w:
        plan = daemon.client.bind(w.pid, 0)["plan"]["npus"]["0"]
        main, acl = frozenset(plan["main"]), frozenset(plan["acl"])
        late = w.spawn("worker_late")
        assert w.born_cpus(late) == main
        seen_from = passes(daemon) + 2  # a whole pass began after the thread existed: it is cached as main
        assert wait_for(lambda: passes(daemon) >= seen_from, 10)
        assert cpus_allowed_of(w.pid, late) == main
        w.rename(late, "acl_thread")
        # caught while young (or, on a host too busy for that, by the comm sweep)
        assert wait_for(lambda: cpus_allowed_of(w.pid, late) == acl, 45), daemon.log()[-3000:]
        assert daemon.client.worker(w.pid)["late_threads_pinned"] >= 1
        assert drift_of(daemon, w.pid)["events"] == 0  # a rename is no drift
    assert YOUNG_PASSES >= 2


# ---------------------------------------------------------------- status and explain


def test_status_says_why_per_worker_and_explains_a_bound_plan(daemon):
    with start_worker(plain=1, acl=1, release=0) as w:
        daemon.client.bind(w.pid, 0)
        out = status_cli(daemon)
        assert out.returncode == 0, out.stderr
        row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == [str(w.pid)])
        assert row[1:3] == ["0", "aligned"]
        # every step that was not applied is listed with its reason (the fixture NPU has no MSI IRQs)
        assert f"  {w.pid}: step irq skipped [no_msi_irqs]:" in out.stdout
        assert "not_applicable" not in out.stdout

        out = status_cli(daemon, "--pid", str(w.pid), "--explain")
        assert out.returncode == 0, out.stderr
        text = out.stdout.split(f"plan explanation of pid {w.pid}:\n", 1)[1]
        assert text.startswith("targets: NPU 0 by rule request: ") and "\nalignment: topology_policy " in text
        assert "\nNPU 0\n  hints\n" in text and "  decision admitted" in text

        out = status_cli(daemon, "--pid", str(w.pid), "--format", "json")
        assert out.returncode == 0, out.stderr
        record = json.loads(out.stdout)["workers"][0]
        assert record["pid"] == w.pid and "explanation" not in record
        cl = record["cpulists"]["npus"]["0"]
        assert parse_cpulist(cl["main"]) == frozenset(record["plan"]["npus"]["0"]["main"])
        assert parse_cpulist(record["cpulists"]["original"]) == frozenset(record["original_cpus"])
        assert record["alignment"] == {"aligned": True, "policy": "none", "failure": None, "reason": None}
        # short arrays on one line, not one number per line (the target rule's evidence takes ~40)
        assert len(out.stdout.splitlines()) < 240

        status, body = daemon.curl("GET", f"/v1/workers?pid={w.pid}&explain=1")
        assert status == 200 and body["workers"][0]["explanation"].startswith("targets: ")
    for bad in ("pid=x", "colour=red", "explain=1", "pid=1&explain=maybe", "pid=0"):
        status, body = daemon.curl("GET", f"/v1/workers?{bad}")
        assert status == 400 and body["error"] == "bad_request", (bad, body)
    out = status_cli(daemon, "--explain")
    assert out.returncode == 2 and "--explain needs --pid" in out.stderr
    out = status_cli(daemon, "--pid", str(2 ** 22 + 7))
    assert out.returncode == 6 and "not bound" in out.stderr


def test_a_binding_restored_after_a_restart_is_explained_from_facts_read_again(tmp_path):
    with start_worker(plain=1, acl=0, release=0) as w:
        with running_daemon(str(tmp_path)) as d:
            d.wait_discovered()
            d.client.bind(w.pid, 0)
            d.stop()  # bindings stay in place
            d2 = DaemonProc(str(tmp_path), d.env).start()
            try:
                d2.wait_discovered()
                explanation = d2.client.worker(w.pid, explain=True)["explanation"]
                assert explanation.startswith("note: this binding predates the daemon's start")
                assert "\nalignment: topology_policy none" in explanation and "\nNPU 0\n" in explanation
                d2.client.release(w.pid)
            finally:
                d2.stop()
