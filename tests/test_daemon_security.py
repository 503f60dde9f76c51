"""A real daemon against the binds it must refuse or undo: pid 1, kernel threads
and the daemon itself (403 ``not_a_worker``, through the API, the CLI and
auto-bind), and an unprivileged user squatting an NPU with an idle process
(evicted by the worker npu-smi lists there, never the other way round).

npu-smi is the fixture fake behind a small wrapper that lists, on NPU 0, the
pids written in a file the test controls (``daemon`` stands for the daemon's
own pid: the wrapper's parent), so the process table changes without a restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ascendbind.discovery.gather.process import read_identity
from tests.daemon_harness import FIXTURE_BIN, ROOT, metric_value, public_daemon, running_daemon, wait_for
from tests.workers import cpus_allowed_of, start_worker

_WRAPPER = '''#!{python}
import os, sys
with open({listed!r}) as fh:
    tokens = fh.read().split()
pids = [str(os.getppid()) if t == "daemon" else t for t in tokens]
os.environ["ASCENDBIND_FAKE_NPU_PIDS"] = ",".join(pids)
os.execv(sys.executable, [sys.executable, {fake!r}, *sys.argv[1:]])
'''

# run as uid 65534: start an idle child, ask the daemon to bind it to NPU 0,
# report, and keep the child alive until stdin closes
_SQUATTER = r'''
import json, subprocess, sys
from ascendbind.client import Client
child = subprocess.Popen(["sleep", "600"])
try:
    body = Client(sys.argv[1], timeout=60).bind(child.pid, 0)
    print(json.dumps({"child": child.pid, "ok": True, "body": body}), flush=True)
except Exception as exc:
    print(json.dumps({"child": child.pid, "ok": False, "code": getattr(exc, "code", repr(exc)),
                      "detail": str(exc)}), flush=True)
sys.stdin.read()
child.kill()
child.wait()
'''


def kernel_thread(prefix: str) -> int:
    for name in sorted(os.listdir("/proc"), key=lambda n: (len(n), n)):
        if name.isdigit():
            ident = read_identity(int(name))
            if ident is not None and ident.is_kthread and ident.comm.startswith(prefix):
                return ident.pid
    pytest.skip(f"no {prefix} kernel thread visible here")


def masks(pid: int) -> dict[int, frozenset[int] | None]:
    return {int(t): cpus_allowed_of(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture
def host_processes_kept():
    """Masks of init, kthreadd and a ksoftirqd; put back should a regression change them."""
    pids = (1, 2, kernel_thread("ksoftirqd/"))
    before = {pid: masks(pid) for pid in pids}
    yield pids, before
    for pid, old in before.items():
        for tid, cpus in old.items():
            if cpus and cpus_allowed_of(pid, tid) not in (None, cpus):
                try:
                    os.sched_setaffinity(tid, cpus)
                except OSError:
                    pass


def _env_for(directory: str, listed_tokens: str, **extra: str) -> dict[str, str]:
    listed = os.path.join(directory, "listed")
    with open(listed, "w") as fh:
        fh.write(listed_tokens)
    wrapper = os.path.join(directory, "npu-smi")
    with open(wrapper, "w") as fh:
        fh.write(_WRAPPER.format(python=sys.executable, listed=listed, fake=str(FIXTURE_BIN / "npu-smi")))
    os.chmod(wrapper, 0o755)
    return {"ASCENDBIND_NPU_SMI": wrapper, **extra}


@pytest.fixture(scope="module")
def daemon():
    with public_daemon("ascendbind-sec-", lambda directory: _env_for(directory, "")) as d:
        d.listed = os.path.join(d.dir, "listed")
        yield d


pytestmark = pytest.mark.usefixtures("daemon_survives")  # each test leaves the shared daemon as it found it


def list_on_npu0(daemon, *pids: int) -> None:
    with open(daemon.listed, "w") as fh:
        fh.write(" ".join(map(str, pids)))


# ---------------------------------------------------------------- never a worker


def test_init_kernel_threads_and_the_daemon_itself_are_refused_and_untouched(daemon, host_processes_kept):
    pids, before = host_processes_kept
    daemon_thread = next(int(t) for t in os.listdir(f"/proc/{daemon.pid}/task") if int(t) != daemon.pid)
    rejected = metric_value(daemon.metrics_text(), "ascendbind_bind_requests_total", outcome="rejected")
    for pid in (*pids, daemon.pid, daemon_thread):
        status, body = daemon.curl("POST", "/v1/bind", {"pid": pid, "npu": 0})
        assert (status, body["error"]) == (403, "not_a_worker"), (pid, body)
        status, body = daemon.curl("GET", f"/v1/plan?pid={pid}&npu=0")
        assert (status, body["error"]) == (403, "not_a_worker"), (pid, body)
    assert daemon.client.workers()["workers"] == []
    for pid in pids:
        assert masks(pid) == before[pid], pid  # read back from /proc/<pid>/task/*/status
    after = metric_value(daemon.metrics_text(), "ascendbind_bind_requests_total", outcome="rejected")
    assert after == rejected + 5


def test_cli_bind_of_pid_1_exits_7_with_the_reason(daemon, host_processes_kept):
    r = subprocess.run([sys.executable, "-m", "ascendbind", "bind", "--pid", "1", "--npu", "0",
                        "--socket", daemon.sock], capture_output=True, text=True, cwd=str(ROOT), timeout=60)
    assert r.returncode == 7, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == ["ascendbind: pid 1 is init (pid 1) of this pid namespace: "
                                             "ascendbind never binds it"]


# ---------------------------------------------------------------- squatting


def squat(daemon, prefix):
    """A uid-65534 process that bound its idle child to NPU 0: (Popen, report)."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c", _SQUATTER, daemon.sock], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    return proc, json.loads(proc.stdout.readline())


def unsquat(proc) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)
    proc.stdout.close()


def test_an_unlisted_squatter_gives_way_to_the_worker_npu_smi_lists(daemon, nobody_prefix):
    os.chmod(daemon.sock, 0o666)  # let uid 65534 connect at all
    squatter = None
    try:
        with start_worker(plain=1, acl=1, release=1) as w:
            list_on_npu0(daemon, w.pid)
            squatter, report = squat(daemon, nobody_prefix)
            assert report["ok"], report
            child = report["child"]
            original = frozenset(os.sched_getaffinity(0))  # inherited from us through setpriv
            assert cpus_allowed_of(child, child) == frozenset(report["body"]["plan"]["npus"]["0"]["main"])
            evicted = metric_value(daemon.metrics_text(), "ascendbind_workers_dropped_total", reason="evicted")

            status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
            assert status == 200, body
            assert body["replaced"] == [child]
            assert [x["pid"] for x in daemon.client.workers()["workers"]] == [w.pid]
            # the squatter's binding is undone: its thread is back on the CPUs it had before
            assert cpus_allowed_of(child, child) == original
            text = daemon.metrics_text()
            assert metric_value(text, "ascendbind_workers_dropped_total", reason="evicted") == evicted + 1
            assert "unproven holder evicted" in daemon.log()

            # the other way round: the listed worker keeps its NPU against an unlisted newcomer
            unsquat(squatter)
            squatter, report = squat(daemon, nobody_prefix)
            assert not report["ok"] and report["code"] == "npu_busy", report
            assert "npu-smi lists it there" in report["detail"]
            assert [x["pid"] for x in daemon.client.workers()["workers"]] == [w.pid]
    finally:
        os.chmod(daemon.sock, 0o660)
        if squatter is not None:
            unsquat(squatter)


def test_a_listed_holder_is_never_evicted_even_by_root(daemon):
    with start_worker(plain=1, acl=0, release=0) as a, start_worker(plain=1, acl=0, release=0) as b:
        list_on_npu0(daemon, a.pid, b.pid)
        assert daemon.curl("POST", "/v1/bind", {"pid": a.pid, "npu": 0})[0] == 200
        before = b.cpus_allowed()
        status, body = daemon.curl("POST", "/v1/bind", {"pid": b.pid, "npu": 0})
        assert (status, body["error"]) == (409, "npu_busy"), body
        assert b.cpus_allowed() == before
        assert [x["pid"] for x in daemon.client.workers()["workers"]] == [a.pid]


def test_explain_is_for_root_and_the_workers_owner_and_reads_nothing_for_others(daemon, nobody_prefix):
    with start_worker(plain=1, acl=0, release=0) as w:
        assert daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})[0] == 200
        os.chmod(daemon.sock, 0o666)
        status, body = daemon.curl("GET", f"/v1/workers?pid={w.pid}&explain=1", prefix=nobody_prefix)
        assert (status, body["error"]) == (403, "not_permitted"), body
        assert "explanation" not in body
        # the plain listing stays open to every user; only the explanation reads the worker again
        status, body = daemon.curl("GET", f"/v1/workers?pid={w.pid}", prefix=nobody_prefix)
        assert status == 200 and "explanation" not in body["workers"][0], body
        status, body = daemon.curl("GET", f"/v1/workers?pid={w.pid}&explain=1")
        assert status == 200 and "decision" in body["workers"][0]["explanation"], body


# ---------------------------------------------------------------- auto-bind


def test_auto_bind_never_picks_init_kernel_threads_or_itself(tmp_path, host_processes_kept):
    pids, before = host_processes_kept
    directory = str(tmp_path)
    with start_worker(plain=1) as w:
        env = _env_for(directory, " ".join([*map(str, pids), "daemon", str(w.pid)]),
                       ASCENDBIND_AUTO_BIND="true", ASCENDBIND_AUTO_BIND_SECONDS="1")
        with running_daemon(directory, **env) as d:
            refused = lambda: {json.loads(line)["pid"] for line in d.log().splitlines()  # noqa: E731
                               if '"auto-bind failed"' in line and '"not_a_worker"' in line}
            assert wait_for(lambda: refused() == {*pids, d.pid}, 30), d.log()
            assert wait_for(lambda: [x["pid"] for x in d.client.workers()["workers"]] == [w.pid], 30), d.log()
            for pid in pids:
                assert masks(pid) == before[pid], pid
            assert d.log().count('"auto-bind failed"') == 4  # once each, remembered, not retried
