"""Thread classes for real: a real ``ascendbind serve`` configured with UCM's class, binding a
real worker whose ``ucm_*`` thread runs beside its main threads, and threads of the classes
started or renamed after the bind.

This host has 2 CPUs, so the fixture NPU's pool is 2 CPUs and, under ``small_pool =
"share"``, main is one CPU and ACL and release the other. UCM's share (the second half of
main) is then all of main, the one-CPU rule, shown here live; the split of a wider main is
test_thread_classes.py's, on planned hosts. So that a class visibly moves a thread off
main, the config also sends ``hccl*`` threads to the release CPU by role."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.daemon_harness import ROOT, metric_value, running_daemon, wait_for
from tests.workers import cpus_allowed_of, start_worker

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="roles only separate with 2+ CPUs")

CLASSES = "ucm:ucm_*:second-half;hccl:hccl*:release"


def _status(d) -> str:
    r = subprocess.run([sys.executable, "-m", "ascendbind.cli", "status"], capture_output=True, text=True,
                       env=d.env, cwd=str(ROOT), timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_ucm_thread_sits_on_its_share_of_main_after_the_bind_and_after_a_late_start(tmp_path):
    with running_daemon(str(tmp_path), ASCENDBIND_THREAD_CLASSES=CLASSES) as d:
        d.wait_discovered()
        with start_worker(plain=2, acl=1, release=1, names=("ucm_store_0", "hccl_send")) as w:
            answer = d.client.bind(w.pid, 0)
            npu = answer["plan"]["npus"]["0"]
            main, release = frozenset(npu["main"]), frozenset(npu["release"])
            assert len(main) == 1 and main != release  # the one-CPU rule: UCM's half is all of main
            assert npu["classes"] == {"ucm": sorted(main)}
            assert [c["name"] for c in answer["plan"]["thread_classes"]] == ["ucm", "hccl"]
            by_name = {comm: tid for tid, comm in w.threads().items()}
            assert cpus_allowed_of(w.pid, by_name["ucm_store_0"]) == main
            assert cpus_allowed_of(w.pid, by_name["hccl_send"]) == release
            assert cpus_allowed_of(w.pid, by_name["worker_0"]) == main

            late_ucm = w.spawn("ucm_late_1")
            late_hccl = w.spawn("hccl_late")
            renamed = w.spawn("worker_9")
            w.rename(renamed, "hccl_recv")
            assert wait_for(lambda: cpus_allowed_of(w.pid, late_hccl) == release, 15), d.log()[-3000:]
            # with process events the rename is news at once; without them (listing mode) a
            # renamed thread is read again within one comm sweep: 30 passes of a second
            assert wait_for(lambda: cpus_allowed_of(w.pid, renamed) == release, 40), d.log()[-3000:]
            assert wait_for(lambda: cpus_allowed_of(w.pid, late_ucm) == main, 15), d.log()[-3000:]
            assert wait_for(lambda: d.client.worker(w.pid)["late_threads_pinned"] >= 2, 15)

            workers = d.client.workers()["workers"]
            assert workers[0]["cpulists"]["npus"]["0"]["classes"] == {"ucm": ",".join(map(str, sorted(main)))}
            roles = workers[0]["contention"]["roles"]
            assert roles["ucm"]["threads"] == 2  # ucm_store_0 and ucm_late_1, counted under the class
            assert roles["release"]["threads"] >= 4  # release_thread and the three hccl threads
            assert metric_value(d.metrics_text(), "ascendbind_role_cpu_seconds_total", npu="0", role="ucm") is not None
            text = _status(d)
            assert f"{w.pid}: thread classes: ucm (ucm_*) -> {sorted(main)[0]}; hccl (hccl*) -> release" in text


def test_a_moved_class_thread_is_set_back_to_its_class_cpus(tmp_path):
    with running_daemon(str(tmp_path), ASCENDBIND_THREAD_CLASSES=CLASSES, ASCENDBIND_DRIFT_SWEEP_PASSES="1") as d:
        d.wait_discovered()
        with start_worker(plain=1, acl=0, release=0, names=("hccl_send",)) as w:
            npu = d.client.bind(w.pid, 0)["plan"]["npus"]["0"]
            main, release = frozenset(npu["main"]), frozenset(npu["release"])
            tid = next(t for t, comm in w.threads().items() if comm == "hccl_send")
            assert cpus_allowed_of(w.pid, tid) == release
            os.sched_setaffinity(tid, main)  # someone else moves the class's thread onto main
            assert wait_for(lambda: cpus_allowed_of(w.pid, tid) == release, 15), d.log()[-3000:]
            assert d.client.worker(w.pid)["drift"]["events"] >= 1


def test_a_reload_that_changes_the_classes_binds_the_worker_again_by_them(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("reconcile_seconds = 1\n")
    with running_daemon(str(tmp_path), ASCENDBIND_CONFIG=str(cfg)) as d:
        d.wait_discovered()
        with start_worker(plain=1, acl=0, release=0, names=("hccl_send",)) as w:
            npu = d.client.bind(w.pid, 0)["plan"]["npus"]["0"]
            main, release = frozenset(npu["main"]), frozenset(npu["release"])
            tid = next(t for t, comm in w.threads().items() if comm == "hccl_send")
            assert cpus_allowed_of(w.pid, tid) == main  # no class yet: a thread like any other
            cfg.write_text('reconcile_seconds = 1\n[[thread_classes]]\nname = "hccl"\nmatch = "hccl*"\n'
                           'role = "release"\n')
            d.proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: cpus_allowed_of(w.pid, tid) == release, 15), d.log()[-3000:]
            plan = d.client.worker(w.pid)["plan"]
            assert plan["thread_classes"] == [{"name": "hccl", "match": ["hccl*"], "role": "release"}]
            assert metric_value(d.metrics_text(), "ascendbind_replans_total", reason="classes_changed",
                                outcome="rebound") == 1
