"""Late role threads are pinned at once: the reconcile loop sleeps on the process events of
the workers it holds, against a real ``ascendbind serve`` whose passes are a minute apart,
with real workers whose threads are born into a role or renamed into one."""

from __future__ import annotations

import os

import pytest

from tests.daemon_harness import metric_value, running_daemon, wait_for
from tests.workers import cpus_allowed_of, start_worker

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="roles only separate with 2+ CPUs")


def _runs(d, name: str) -> float:
    return metric_value(d.metrics_text(), name) or 0


def test_a_thread_born_or_renamed_into_a_role_is_pinned_without_waiting_for_a_pass(tmp_path):
    with running_daemon(str(tmp_path), ASCENDBIND_RECONCILE_SECONDS="60") as d:
        d.wait_discovered()
        mode = d.client.health()["reconcile"]
        if mode["mode"] != "events":
            if os.environ.get("CI") == "true":
                pytest.fail(f"no process events for the loop: {mode}")
            pytest.skip(f"no process events for the loop: {mode}")
        with start_worker(plain=1, acl=0, release=0) as w:
            plan = d.client.bind(w.pid, 0)["plan"]["npus"]["0"]
            main, acl = frozenset(plan["main"]), frozenset(plan["acl"])
            assert main != acl
            passes = _runs(d, "ascendbind_reconcile_runs_total")
            born = w.spawn("acl_thread")
            assert wait_for(lambda: cpus_allowed_of(w.pid, born) == acl, 10), d.log()[-3000:]
            late = w.spawn("worker_late")
            assert wait_for(lambda: _runs(d, "ascendbind_reconcile_woken_runs_total") >= 2, 10)
            assert cpus_allowed_of(w.pid, late) == main
            w.rename(late, "acl_thread")
            assert wait_for(lambda: cpus_allowed_of(w.pid, late) == acl, 10), d.log()[-3000:]
            # no pass ran meanwhile (a minute apart): the events woke the loop
            assert _runs(d, "ascendbind_reconcile_runs_total") == passes
            assert d.client.worker(w.pid)["late_threads_pinned"] >= 2
            assert d.client.worker(w.pid)["drift"]["events"] == 0
