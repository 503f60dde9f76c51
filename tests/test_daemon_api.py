"""The daemon's socket API against a real ``ascendbind serve`` and real workers.

One daemon serves the whole module (fake one-NPU host, reconcile every second,
small_pool = share); every test reaps its own workers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from ascendbind.applier.affinity import cpus_for_role, role_of
from ascendbind.values.cpulist import format_cpulist
from ascendbind.values.model import Mode, NpuPlan
from tests.daemon_harness import ROOT, metric_value, public_daemon, wait_for
from tests.workers import SELF_BINDER, cpus_allowed_of, nodes_with_cpus, reap, start_worker

N_CPUS = len(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(N_CPUS < 2, reason="roles only separate with 2+ CPUs")


@pytest.fixture(scope="module")
def daemon():
    with public_daemon("ascendbind-api-") as d:  # the unprivileged-peer test reaches its socket
        yield d


pytestmark = pytest.mark.usefixtures("daemon_survives")  # each test leaves the shared daemon as it found it


def npu_plan(plan_json: dict, npu: int = 0) -> NpuPlan:
    p = plan_json["npus"][str(npu)]
    return NpuPlan(npu, tuple(p["pool"]), tuple(p["irq"]), tuple(p["main"]), tuple(p["acl"]),
                   tuple(p["release"]), tuple(p["numa_nodes"]))


def role_masks_ok(worker, plan: NpuPlan) -> bool:
    """Every thread's Cpus_allowed_list (read from /proc) equals its role's CPUs."""
    for tid, comm in worker.threads().items():
        if cpus_allowed_of(worker.pid, tid) != cpus_for_role(plan, role_of(comm), Mode.TOPO_AFFINITY):
            return False
    return True


# ---------------------------------------------------------------- bind, roles, reconcile


def test_bind_through_curl_puts_each_role_on_its_cpus(daemon):
    # the fixture NPU's affinity is every CPU of the host: its pool lies on one NUMA node,
    # and is aligned, only where the host has one; on a multi-node host it spans them all
    outcome = "aligned" if len(nodes_with_cpus()) == 1 else "unaligned"
    with start_worker(plain=2, acl=1, release=1) as w:
        status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, body
        assert body["pid"] == w.pid and body["npus"] == [0] and body["outcome"] == outcome, body
        plan = npu_plan(body["plan"])
        assert role_masks_ok(w, plan)
        comms = w.threads()
        acl_tid = next(t for t, c in comms.items() if c == "acl_thread")
        assert cpus_allowed_of(w.pid, acl_tid) == frozenset(plan.acl)
        status, listing = daemon.curl("GET", "/v1/workers")
        assert status == 200 and [x["pid"] for x in listing["workers"]] == [w.pid]
    text = daemon.metrics_text()
    assert metric_value(text, "ascendbind_bind_requests_total", outcome=outcome) >= 1
    assert metric_value(text, "ascendbind_steps_total", step="affinity", outcome="applied") >= 1


@needs_two_cpus
def test_late_acl_thread_is_repinned_by_the_reconcile_loop(daemon):
    with start_worker(plain=1, acl=0, release=0) as w:
        status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, body
        plan = npu_plan(body["plan"])
        # a reconcile pass that has seen the bound threads, so the next one sees a late thread
        runs = metric_value(daemon.metrics_text(), "ascendbind_reconcile_runs_total")
        assert wait_for(lambda: metric_value(daemon.metrics_text(), "ascendbind_reconcile_runs_total") >= runs + 2, 10)
        tid = w.spawn("acl_thread")
        # born from the main thread, it inherits the main CPUs; it reads its own mask when it first
        # runs, which on a busy box can be after the daemon, told of the new thread, has moved it
        assert w.born_cpus(tid) in (frozenset(plan.main), frozenset(plan.acl))
        assert wait_for(lambda: cpus_allowed_of(w.pid, tid) == frozenset(plan.acl), 5), daemon.log()[-2000:]
        worker = daemon.client.workers()["workers"][0]
        assert worker["late_threads_pinned"] >= 1


@needs_two_cpus
def test_drifted_mask_is_reasserted_and_counted(daemon):
    with start_worker(plain=1, acl=0, release=0) as w:
        status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200
        plan = npu_plan(body["plan"])
        tid = w.tid_named("worker_0")
        os.sched_setaffinity(tid, os.sched_getaffinity(0))  # every CPU it may use, as taskset would
        assert wait_for(lambda: cpus_allowed_of(w.pid, tid) == frozenset(plan.main), 5)
        drift = daemon.client.workers()["workers"][0]["drift"]
        # moved from outside (this test is not the worker) and nothing in the worker binds: external
        assert drift["events"] >= 1 and drift["culprit"] == "external" and not drift["left_alone"]
        assert "no sign that the worker binds itself" in drift["blame"]
    assert metric_value(daemon.metrics_text(), "ascendbind_drift_total", culprit="external") >= 1


@needs_two_cpus
def test_worker_that_keeps_rebinding_itself_without_evidence_is_left_alone_as_external(daemon):
    # nothing in its environment or command line says it binds itself: the daemon cannot tell
    # it from taskset, so the blame is external, never self; it is still left alone at the limit
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_AFFINITY_CONF", "OMP_PROC_BIND", "KMP_AFFINITY",
                                                            "GOMP_CPU_AFFINITY")}
    before = metric_value(daemon.metrics_text(), "ascendbind_drift_total", culprit="self") or 0
    proc = subprocess.Popen([sys.executable, "-c", SELF_BINDER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        status, _ = daemon.curl("POST", "/v1/bind", {"pid": proc.pid, "npu": 0})
        assert status == 200

        def left_alone():
            return daemon.client.workers()["workers"][0]["drift"]["left_alone"]

        assert wait_for(left_alone, 12), daemon.log()[-3000:]
        drift = daemon.client.workers()["workers"][0]["drift"]
        assert drift["culprit"] == "external" and drift["events"] >= 4
        assert "moved again after 3 re-asserts" in drift["left_alone_why"]
        assert "blamed external" in drift["left_alone_why"]
        text = daemon.metrics_text()
        assert metric_value(text, "ascendbind_drift_total", culprit="external") >= 4
        assert (metric_value(text, "ascendbind_drift_total", culprit="self") or 0) == before
    finally:
        reap(proc)


def test_exited_worker_is_dropped_within_seconds(daemon):
    with start_worker(plain=1, acl=0, release=0) as w:
        assert daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})[0] == 200
        pid = w.pid
    t0 = time.monotonic()
    assert wait_for(lambda: daemon.client.workers()["workers"] == [], 5)
    assert time.monotonic() - t0 < 4
    assert metric_value(daemon.metrics_text(), "ascendbind_workers_dropped_total", reason="exited") >= 1
    assert pid not in [w["pid"] for w in daemon.client.workers()["workers"]]


def test_zombie_worker_counts_as_exited(daemon):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert daemon.curl("POST", "/v1/bind", {"pid": proc.pid, "npu": 0})[0] == 200
        proc.stdin.close()  # it exits; we do not reap it yet, so it stays a zombie
        assert wait_for(lambda: open(f"/proc/{proc.pid}/stat").read().rpartition(")")[2].split()[0] == "Z", 5)
        assert wait_for(lambda: daemon.client.workers()["workers"] == [], 5)
    finally:
        proc.wait()


def test_release_restores_the_original_affinity(daemon):
    with start_worker(plain=2, acl=1, release=1) as w:
        before = w.cpus_allowed()
        assert daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})[0] == 200
        status, body = daemon.curl("POST", "/v1/release", {"pid": w.pid})
        assert status == 200 and body["pid"] == w.pid
        assert w.cpus_allowed() == before
        assert daemon.curl("POST", "/v1/release", {"pid": w.pid})[1]["error"] == "not_bound"


def test_plan_endpoint_plans_without_binding(daemon):
    with start_worker(plain=1, acl=0, release=0) as w:
        before = w.cpus_allowed()
        status, body = daemon.curl("GET", f"/v1/plan?pid={w.pid}&npu=0")
        assert status == 200 and body["plan"]["npus"]["0"]["pool"]
        # what the IRQ step would move, as the CLI's plan shows it for the same worker
        cli = subprocess.run([sys.executable, "-m", "ascendbind", "plan", "--pid", str(w.pid), "--npu", "0",
                              "--format", "json"], env=daemon.env, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert body["plan"]["irqs"] == json.loads(cli.stdout)["irqs"] and "0" in body["plan"]["irqs"]
        assert w.cpus_allowed() == before and daemon.client.workers()["workers"] == []
        assert daemon.curl("GET", f"/v1/plan?pid={w.pid}&npu=x")[0] == 400
        assert daemon.curl("GET", f"/v1/plan?pid={w.pid}&colour=red")[0] == 400


def test_bind_without_npu_and_nothing_to_go_by_is_422(daemon):
    with start_worker(plain=1, acl=0, release=0) as w:
        status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid})
        assert status == 422 and body["error"] == "no_target_npu", body
        assert daemon.client.workers()["workers"] == []


# ---------------------------------------------------------------- conflicts


def test_second_worker_on_the_same_npu_gets_409_until_the_first_is_gone(daemon):
    with start_worker(plain=1, acl=0, release=0) as a, start_worker(plain=1, acl=0, release=0) as b:
        assert daemon.curl("POST", "/v1/bind", {"pid": a.pid, "npu": 0})[0] == 200
        status, body = daemon.curl("POST", "/v1/bind", {"pid": b.pid, "npu": 0})
        assert status == 409 and body["error"] == "npu_busy" and str(a.pid) in body["detail"]
        a.close()
        # the owner is dead: the next bind replaces it instead of answering 409
        status, body = daemon.curl("POST", "/v1/bind", {"pid": b.pid, "npu": 0})
        assert status == 200, body
    assert metric_value(daemon.metrics_text(), "ascendbind_bind_requests_total", outcome="failed") >= 1


# ---------------------------------------------------------------- bad input and hostile clients


@pytest.mark.parametrize(
    ("raw", "status", "error"),
    [
        (b"{not json", 400, "bad_json"),
        (b"\xff\xfe\x00garbage", 400, "bad_json"),
        (b"[1, 2, 3]", 400, "bad_request"),
        (b'{"pid": "12"}', 400, "bad_request"),
        (b'{"pid": true}', 400, "bad_request"),
        (b'{"pid": -4}', 400, "bad_request"),
        (b'{"npu": -1}', 400, "bad_request"),
        (b'{"npu": [0, "a"]}', 400, "bad_request"),
        (b'{"npu": 0, "topology_policy": "fastest"}', 400, "bad_request"),
        (b'{"npu": 0, "colour": "red"}', 400, "bad_request"),
        (b'{"pid": 4194303, "npu": 0}', 404, "pid_gone"),
    ],
)
def test_bad_bind_bodies_get_json_errors(daemon, raw, status, error):
    got, body = daemon.curl("POST", "/v1/bind", raw=raw)
    assert (got, body["error"]) == (status, error), body
    assert set(body) >= {"error", "detail"}


def test_routes_methods_and_sizes(daemon):
    rejected = metric_value(daemon.metrics_text(), "ascendbind_bind_requests_total", outcome="rejected")
    assert daemon.curl("GET", "/v1/nothing")[1]["error"] == "not_found"
    status, body = daemon.curl("GET", "/v1/bind")
    assert status == 405 and body["error"] == "method_not_allowed"
    status, body = daemon.curl("POST", "/v1/bind", raw=b'{"npu": 0, "pad": "' + b"x" * 200_000 + b'"}')
    assert status == 413 and body["error"] == "body_too_large"
    status, body = daemon.curl("GET", "/healthz")
    assert status == 200 and body["status"] == "ok"
    assert daemon.curl("POST", "/v1/bind", {"npu": -1})[0] == 400
    text = daemon.metrics_text()
    assert metric_value(text, "ascendbind_bind_requests_total", outcome="rejected") == rejected + 1
    assert metric_value(text, "ascendbind_http_requests_total", path="/v1/bind", code="405") >= 1


def test_unprivileged_peer_cannot_bind_a_root_process(daemon):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not installed")
    with start_worker(plain=1, acl=0, release=0) as w:
        before = w.cpus_allowed()
        os.chmod(daemon.sock, 0o666)  # let uid 65534 connect at all
        try:
            nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0}, prefix=nobody)
            assert status == 403 and body["error"] == "not_permitted", body
            assert w.cpus_allowed() == before and daemon.client.workers()["workers"] == []
            # pid omitted: the peer (curl, uid 65534) binds itself, read from SO_PEERCRED
            status, body = daemon.curl("POST", "/v1/bind", {"npu": 0}, prefix=nobody)
            assert status == 200 and body["pid"] != w.pid, body
            status, body = daemon.curl("POST", "/v1/release", {"all": True}, prefix=nobody)
            assert status == 403
        finally:
            os.chmod(daemon.sock, 0o660)
    assert metric_value(daemon.metrics_text(), "ascendbind_bind_requests_total", outcome="rejected") >= 1


# ---------------------------------------------------------------- metrics


def test_metrics_parse_with_prometheus_client_and_use_fixed_labels(daemon):
    from prometheus_client.parser import text_string_to_metric_families

    text = daemon.metrics_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("ascendbind_bind_requests", "ascendbind_alignment_failures", "ascendbind_steps",
                 "ascendbind_bound_workers", "ascendbind_bind_duration_seconds",
                 "ascendbind_discovery_duration_seconds", "ascendbind_build_info", "ascendbind_drift",
                 "ascendbind_reconcile_runs"):
        assert name in families, name
    outcomes = {s.labels["outcome"] for s in families["ascendbind_bind_requests"].samples}
    assert outcomes == {"aligned", "unaligned", "failed", "rejected"}
    steps = {(s.labels["step"], s.labels["outcome"]) for s in families["ascendbind_steps"].samples}
    assert len(steps) == 12
    assert families["ascendbind_alignment_failures"].samples, "failure series are pre-created"
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
    # the first pass comes one reconcile period after start: wait for it, the test may run first
    assert wait_for(lambda: (metric_value(daemon.metrics_text(), "ascendbind_reconcile_runs_total") or 0) >= 1, 30)
    # the same registry answers on the socket
    status, sock_text = daemon.curl("GET", "/metrics")
    assert status == 200 and "ascendbind_bind_requests_total" in sock_text


def _phases(daemon) -> dict[str, float]:
    from ascendbind.daemon.api.metrics import BIND_PHASES

    text = daemon.metrics_text()
    return {p: metric_value(text, "ascendbind_bind_phase_seconds_total", phase=p) for p in BIND_PHASES}


def test_a_bind_is_timed_phase_by_phase_from_accept_to_the_answer_sent(daemon):
    before = _phases(daemon)
    assert None not in before.values(), before  # every phase's series exists from the start
    with start_worker(plain=3, acl=1, release=1) as w:
        t0 = time.monotonic()
        status, body = daemon.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        elapsed = time.monotonic() - t0
        assert status == 200, body
        # the phases are added once the answer is sent, which the client may read first
        assert wait_for(lambda: _phases(daemon)["answer"] > before["answer"], 10), _phases(daemon)
        after = _phases(daemon)
        spent = {p: after[p] - before[p] for p in before}
        assert all(v > 0 for v in spent.values()), spent
        # every phase lies between the client's connect and its reading the answer
        assert sum(spent.values()) <= elapsed, (spent, elapsed)
        # a refused bind (no such process) is not a bind's time: nothing is added
        status, body = daemon.curl("POST", "/v1/bind", {"pid": 2 ** 22, "npu": 0})  # above any pid_max - 1
        assert status == 404, body
        assert _phases(daemon) == after
        daemon.curl("POST", "/v1/release", {"pid": w.pid})


def test_uevent_triggers_a_debounced_rediscovery(daemon):
    uevent = "/sys/devices/system/cpu/cpu0/uevent"
    if not daemon.client.health()["hotplug"].startswith("kernel") or not os.access(uevent, os.W_OK):
        pytest.skip("no kernel uevent netlink here")
    before = metric_value(daemon.metrics_text(), "ascendbind_rediscoveries_total") or 0
    for _ in range(3):  # a burst: one rediscovery
        with open(uevent, "w") as fh:
            fh.write("change")
    # settled: the burst has been acted upon and nothing more is due
    assert wait_for(lambda: not daemon.client.health()["rediscovery_pending"]
                    and metric_value(daemon.metrics_text(), "ascendbind_rediscoveries_total") > before, 15)
    assert metric_value(daemon.metrics_text(), "ascendbind_rediscoveries_total") == before + 1


# ---------------------------------------------------------------- CLI verbs over the socket


def _cli(daemon, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ascendbind.cli", *args], capture_output=True, text=True,
                          env=daemon.env, cwd=str(ROOT), timeout=60, **kw)


def test_cli_bind_status_release(daemon):
    with start_worker(plain=1, acl=1, release=0) as w:
        r = _cli(daemon, "bind", "--pid", str(w.pid), "--npu", "0")
        assert r.returncode == 0, r.stderr
        assert f"bound pid {w.pid}" in r.stdout
        r = _cli(daemon, "status", "--format", "json", "--memory")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert [x["pid"] for x in doc["workers"]] == [w.pid]
        assert doc["workers"][0]["memory_pages_by_node"]
        assert str(w.pid) in _cli(daemon, "status").stdout
        assert _cli(daemon, "release", "--pid", str(w.pid)).returncode == 0
        assert _cli(daemon, "release", "--pid", str(w.pid)).returncode == 6
        assert _cli(daemon, "bind", "--pid", "4194303", "--npu", "0").returncode == 6
        assert _cli(daemon, "bind", "--pid", str(w.pid), "--npu", "0", "--socket", "/nonexistent.sock").returncode == 4
        r = _cli(daemon, "release", "--all")
        assert r.returncode == 0 and "released" in r.stdout


_PRINT_AFFINITY = "import os,sys; print(sorted(os.sched_getaffinity(0))); sys.exit(3)"


def test_run_binds_the_child_before_exec_and_passes_the_status_through(daemon):
    r = _cli(daemon, "run", "--npu", "0", "--", sys.executable, "-c", _PRINT_AFFINITY)
    assert r.returncode == 3, r.stderr
    status, _ = daemon.curl("GET", "/v1/workers")
    plan_main = None
    # the child was bound (as itself, pid from SO_PEERCRED) before exec: it printed the main CPUs
    with start_worker(plain=0, acl=0, release=0) as probe:
        plan_main = daemon.client.plan(pid=probe.pid, npu=0)["plan"]["npus"]["0"]["main"]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == plan_main


# the command's own view of its memory policy: numa_maps prints it on every mapping without its own,
# as its second field ("prefer:0"; "prefer (many):0-1" holds a space)
_PRINT_POLICY = ("import re; print(re.match(r'\\S+ (prefer \\(many\\)\\S*|\\S+)', "
                 "open('/proc/self/numa_maps').readline()).group(1))")


def _has_preferred_many() -> bool:
    """MPOL_PREFERRED_MANY came with Linux 5.15."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return (major, minor) >= (5, 15)


def test_run_gives_the_command_its_pools_node_as_preferred_memory_before_exec(daemon, record_property):
    r = _cli(daemon, "run", "--npu", "0", "--", sys.executable, "-c", _PRINT_POLICY)
    assert r.returncode == 0, r.stderr
    # the fixture NPU's pool is every CPU: on one node, that node preferred; over several, all of
    # them (MPOL_PREFERRED_MANY), or where the kernel predates it the first one alone
    nodes = sorted(nodes_with_cpus())
    if len(nodes) == 1:
        want = f"prefer:{nodes[0]}"
    elif _has_preferred_many():
        want = f"prefer (many):{format_cpulist(nodes)}"
    else:
        want = f"prefer:{nodes[0]}"
    policy = r.stdout.strip().splitlines()[-1]
    record_property("run_memory_policy", policy)
    print(f"\nrun's memory policy on {len(nodes)} node(s), Linux {os.uname().release}: {policy}")
    assert policy == want and "memory policy" not in r.stderr, (policy, want, r.stderr)
    # a command started under a policy of its own keeps it: numactl's comes first, run's bind after
    numactl = shutil.which("numactl")
    if numactl is None:
        from tests.deploy_tools import missing

        missing("numactl (Debian package numactl)")
    r = subprocess.run([numactl, "--interleave=0", sys.executable, "-m", "ascendbind.cli", "run", "--npu", "0", "--",
                        sys.executable, "-c", _PRINT_POLICY], capture_output=True, text=True, env=daemon.env,
                       cwd=str(ROOT), timeout=60)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("interleave"), r.stderr
    assert "already has one of its own" in r.stderr


def test_run_forwards_signals_and_dies_the_same_way(daemon):
    p = subprocess.Popen([sys.executable, "-m", "ascendbind.cli", "run", "--npu", "0", "--", "sleep", "30"],
                         env=daemon.env, cwd=str(ROOT))
    try:
        assert wait_for(lambda: len(daemon.client.workers()["workers"]) == 1, 10)
        p.send_signal(15)
        assert p.wait(timeout=10) == -15
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_run_without_a_daemon_warns_or_refuses(daemon):
    env = dict(daemon.env, ASCENDBIND_SOCKET="/nonexistent/ascendbind.sock")
    r = subprocess.run([sys.executable, "-m", "ascendbind.cli", "run", "--npu", "0", "--", "true"],
                       capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=30)
    assert r.returncode == 0 and "running unbound" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ascendbind.cli", "run", "--npu", "0", "--require-binding", "--",
                        "sh", "-c", "echo ran"], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=30)
    assert r.returncode == 4 and "ran" not in r.stdout
