"""A bind that names its NPU is answered without npu-smi's process table, then checked
against it: a real daemon, real workers, and the fixture npu-smi describing two NPUs
whose process table lists the pids (``PID:NPU``) written in a file the test controls.
"""

from __future__ import annotations

import os

import pytest

from tests.daemon_harness import metric_value, public_daemon, wait_for
from tests.test_daemon_security import _env_for
from tests.workers import start_worker


@pytest.fixture(scope="module")
def daemon():
    with public_daemon("ascendbind-npucheck-",
                       lambda directory: _env_for(directory, "", ASCENDBIND_FAKE_NPUS="2")) as d:
        d.listed = os.path.join(d.dir, "listed")
        yield d


pytestmark = pytest.mark.usefixtures("daemon_survives")  # each test leaves the shared daemon as it found it


def list_as(daemon, **where: int) -> None:
    with open(daemon.listed, "w") as fh:
        fh.write(" ".join(f"{pid}:{npu}" for pid, npu in where.values()))


def checks(daemon, verdict: str) -> float:
    return metric_value(daemon.metrics_text(), "ascendbind_npu_checks_total", verdict=verdict) or 0


def held(daemon, pid: int) -> dict | None:
    return next((w for w in daemon.client.workers()["workers"] if w["pid"] == pid), None)


def test_a_named_npu_the_table_contradicts_is_undone_after_the_answer(daemon):
    dropped = metric_value(daemon.metrics_text(), "ascendbind_workers_dropped_total", reason="npu_mismatch") or 0
    contradicted = checks(daemon, "contradicted")
    with start_worker(plain=1, acl=0, release=0) as w:
        before = w.cpus_allowed()
        list_as(daemon, w=(w.pid, 1))  # npu-smi lists the worker on NPU 1
        status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        # the bind itself does not run npu-smi: it is answered as asked
        assert status == 200 and body["npus"] == [0], body
        assert wait_for(lambda: held(daemon, w.pid) is None, 30), daemon.log()[-2000:]
        assert w.cpus_allowed() == before  # the binding was undone, as a release undoes it
        text = daemon.metrics_text()
        assert metric_value(text, "ascendbind_workers_dropped_total", reason="npu_mismatch") == dropped + 1
        assert checks(daemon, "contradicted") == contradicted + 1
        assert "named NPU contradicted by npu-smi" in daemon.log()
        # its next bind, naming the NPU the table lists, binds and is confirmed
        confirmed = checks(daemon, "confirmed")
        assert daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 1})[0] == 200
        assert wait_for(lambda: (held(daemon, w.pid) or {}).get("npu_check"), 30)
        assert held(daemon, w.pid)["npu_check"]["verdict"] == "confirmed"
        assert checks(daemon, "confirmed") == confirmed + 1


def test_an_unlisted_worker_keeps_its_named_npu_and_says_so(daemon):
    with start_worker(plain=1, acl=0, release=0) as w:
        assert daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 1})[0] == 200
        assert wait_for(lambda: (held(daemon, w.pid) or {}).get("npu_check"), 30), daemon.log()[-2000:]
        check = held(daemon, w.pid)["npu_check"]
        assert check["verdict"] == "unlisted" and "does not list" in check["detail"], check
        assert held(daemon, w.pid)["npus"] == [1]


def test_a_bind_that_names_no_npu_reads_the_table_itself_and_is_not_checked_again(daemon):
    total = sum(checks(daemon, v) for v in ("confirmed", "unlisted", "unverified", "contradicted"))
    with start_worker(plain=1, acl=0, release=0) as w, start_worker(plain=1, acl=0, release=0) as named:
        list_as(daemon, w=(w.pid, 1))
        status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid})
        assert status == 200 and body["npus"] == [1], body
        # checks run one at a time in the order asked: once the named bind's verdict is in,
        # a check of the first bind would have been counted too
        assert daemon.curl("POST", "/v1/bind", {"pid": named.pid, "npu": 0})[0] == 200
        assert wait_for(lambda: (held(daemon, named.pid) or {}).get("npu_check"), 30)
        assert held(daemon, w.pid)["npu_check"] is None
        assert sum(checks(daemon, v) for v in ("confirmed", "unlisted", "unverified", "contradicted")) == total + 1
