"""Daemon lifecycle with real processes: kill -9 and restart, npu-smi failing,
SIGHUP, auto-bind, systemd socket activation / sd_notify / journald logs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys

import pytest

from tests.daemon_harness import FIXTURE_BIN, ROOT, DaemonProc, base_env, free_port, metric_value, wait_for
from tests.hanging_tool import HangingNpuSmi
from tests.workers import cpus_allowed_of, nodes_with_cpus, start_worker

TWO_CPUS = len(os.sched_getaffinity(0)) >= 2


def _daemon(tmp_path, *, argv=None, **extra) -> DaemonProc:
    env = base_env(str(tmp_path / "ascendbind.sock"), str(tmp_path / "state"), free_port(), **extra)
    return DaemonProc(str(tmp_path), env, argv)


def test_kill_9_and_restart_keeps_live_workers_and_drops_gone_ones(tmp_path):
    d = _daemon(tmp_path).start()
    try:
        with start_worker(plain=1, acl=0, release=0) as keep, start_worker(plain=1, acl=0, release=0) as gone:
            assert d.curl("POST", "/v1/bind", {"pid": keep.pid, "npu": 0})[0] == 200
            d.client.release(keep.pid)  # exercise release, then bind again: state reflects the last word
            assert d.curl("POST", "/v1/bind", {"pid": keep.pid, "npu": 0})[0] == 200
            state = json.loads((tmp_path / "state" / "state.json").read_text())
            assert [w["pid"] for w in state["workers"]] == [keep.pid]
            assert stat.S_IMODE(os.stat(tmp_path / "state" / "state.json").st_mode) == 0o600
            d.stop(signal.SIGKILL)
            assert os.path.exists(d.sock)  # a stale socket file is left behind by kill -9
            gone_pid = gone.pid
            gone.close()  # ... and one worker exits while no daemon is running

            d2 = DaemonProc(str(tmp_path), d.env).start()
            try:
                workers = d2.client.workers()["workers"]
                assert [w["pid"] for w in workers] == [keep.pid]
                assert gone_pid not in [w["pid"] for w in workers]
                if TWO_CPUS:
                    # reconciling resumed: a late acl_thread is pinned by the new daemon
                    acl = set(workers[0]["plan"]["npus"]["0"]["acl"])
                    tid = keep.spawn("acl_thread")
                    assert wait_for(lambda: cpus_allowed_of(keep.pid, tid) == acl, 5), d2.log()[-2000:]
                status, body = d2.curl("POST", "/v1/release", {"pid": keep.pid})
                assert status == 200, body
            finally:
                d2.stop()
    finally:
        d.stop()


def test_a_second_daemon_refuses_a_live_socket(tmp_path):
    d = _daemon(tmp_path).start()
    try:
        other = DaemonProc(str(tmp_path), dict(d.env, ASCENDBIND_METRICS_LISTEN=f"127.0.0.1:{free_port()}"))
        other.start(wait=False)
        assert other.proc.wait(timeout=15) == 2
        assert "already listening" in other.log()
        d.wait_discovered()
        assert d.client.health()["status"] == "ok"
    finally:
        d.stop()


def test_a_state_dir_under_a_file_is_blamed_by_name_not_the_socket(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    state_dir = str(blocker / "state")
    d = DaemonProc(str(tmp_path), base_env(str(tmp_path / "ascendbind.sock"), state_dir, free_port()))
    d.start(wait=False)
    assert d.proc.wait(timeout=30) == 2
    last = d.log().strip().splitlines()[-1]
    assert last == f"ascendbind: state_dir {state_dir}: {blocker} is not a directory", d.log()
    assert "Traceback" not in d.log() and "cannot listen" not in d.log()
    d.stop()


def test_corrupt_or_untrusted_state_is_moved_aside_and_the_daemon_starts(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "state.json").write_text('{"version": 1, "workers": [tru')
    d = _daemon(tmp_path).start()
    try:
        assert d.client.workers()["workers"] == []
        assert [p.name for p in state_dir.iterdir() if p.name.startswith("state.json.corrupt-")]
        assert "state file not used" in d.log()
    finally:
        d.stop()


_FAKES = {
    "garbage": "#!/bin/sh\necho '### not an npu-smi table at all ###'\n",
    "good": f'#!/bin/sh\nexec "{FIXTURE_BIN}/npu-smi" "$@"\n',
}


def _install(path, kind: str) -> None:
    tmp = f"{path}.new"
    with open(tmp, "w") as fh:
        fh.write(_FAKES[kind])
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)


def _failing(d: DaemonProc) -> list[tuple[str, str]]:
    return [(f["query"], f["error"]) for f in d.client.health()["failing"]]


def test_npu_smi_missing_or_garbage_gives_503_naming_it_and_the_daemon_stays_up(tmp_path):
    npu_smi = tmp_path / "bin" / "npu-smi"
    npu_smi.parent.mkdir()
    d = _daemon(tmp_path, ASCENDBIND_NPU_SMI=str(npu_smi), ASCENDBIND_COMMAND_TIMEOUT_SECONDS="5").start()
    try:
        with start_worker(plain=1, acl=0, release=0) as w:
            def bind():
                return d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})

            assert wait_for(lambda: _failing(d) == [("host_facts", "npu_smi_missing")], 15), d.log()[-2000:]
            status, body = bind()
            assert status == 503 and body["error"] == "discovery_unavailable", body
            assert "npu_smi_missing" in body["detail"] and "npu-smi not found" in body["detail"]
            health = d.client.health()
            assert health["status"] == "degraded" and "npu_smi_missing" in health["discovery"]

            # SIGHUP rediscovers at once, whatever the backoff says
            _install(npu_smi, "garbage")
            d.proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: _failing(d) == [("host_facts", "parse_error")], 15), d.log()[-2000:]
            status, body = bind()
            assert status == 503 and body["error"] == "discovery_unavailable" and "parse_error" in body["detail"]

            _install(npu_smi, "good")
            d.proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: d.client.health()["status"] == "ok", 15), d.log()[-2000:]
            assert d.client.health()["failing"] == []
            assert bind()[0] == 200
        assert d.alive()
        text = d.metrics_text()
        assert metric_value(text, "ascendbind_discovery_errors_total", code="parse_error") >= 1
        assert metric_value(text, "ascendbind_bind_requests_total", outcome="failed") >= 2
    finally:
        d.stop()


BINDS = 6
# the fake answers with `cat`: a second is plenty on a loaded machine, and what a hang costs
TIMEOUT = "1"


def test_a_hanging_npu_smi_costs_one_timeout_then_binds_fail_fast_until_it_answers(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    fake.hang()
    d = _daemon(tmp_path, ASCENDBIND_NPU_SMI=str(fake.path), ASCENDBIND_COMMAND_TIMEOUT_SECONDS=TIMEOUT).start()
    try:
        # the start-up discovery waits out one timeout, on its first npu-smi run
        assert wait_for(lambda: _failing(d) == [("host_facts", "command_timeout")], 20), d.log()[-2000:]
        assert fake.calls()[0] == "info -m"
        with start_worker(plain=1, acl=0, release=0) as w:
            before = len(fake.calls())
            for _ in range(BINDS):
                status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
                assert status == 503 and body["error"] == "discovery_unavailable", body
                assert "command_timeout" in body["detail"] and "npu-smi info -m timed out" in body["detail"]
            # only the background retries ran npu-smi meanwhile, on their doubling backoff: no bind did
            assert len(fake.calls()) - before < BINDS, fake.calls()
            health = d.client.health()
            assert health["status"] == "degraded" and health["failing"][0]["query"] == "host_facts"

            fake.answer()
            assert wait_for(lambda: d.client.health()["status"] == "ok", 60), d.log()[-2000:]
            status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
            assert status == 200, body
        assert fake.hung_runs() >= 1 and fake.wait_no_survivors() == []
        text = d.metrics_text()
        assert metric_value(text, "ascendbind_discovery_errors_total", code="command_timeout") >= 1
        assert metric_value(text, "ascendbind_bind_requests_total", outcome="failed") >= BINDS
    finally:
        d.stop()


def test_a_hanging_process_table_fails_binds_without_npu_fast_and_healthz_names_it(tmp_path):
    fake = HangingNpuSmi(tmp_path)
    d = _daemon(tmp_path, ASCENDBIND_NPU_SMI=str(fake.path), ASCENDBIND_COMMAND_TIMEOUT_SECONDS=TIMEOUT).start()
    try:
        with start_worker(plain=1, acl=0, release=0) as w, start_worker(plain=1, acl=0, release=0) as other:
            fake.set_pids([w.pid])
            d.wait_discovered()
            fake.hang("info")  # the static facts are cached: only the process table asks npu-smi now
            before = len(fake.calls())
            status, body = d.curl("POST", "/v1/bind", {"pid": w.pid})
            assert status == 503 and body["error"] == "command_timeout", body
            assert f"npu-smi info timed out after {TIMEOUT}s" in body["detail"]
            assert fake.calls()[before] == "info"
            for _ in range(BINDS):
                status, body = d.curl("POST", "/v1/bind", {"pid": w.pid})
                assert status == 503 and body["error"] == "discovery_unavailable", body
                assert "process table" in body["detail"]
            assert len(fake.calls()) - before < BINDS + 1, fake.calls()
            health = d.client.health()
            assert health["status"] == "degraded", health
            assert [(f["query"], f["error"]) for f in health["failing"]] == [("process_table", "command_timeout")]
            # a bind that names its NPU needs no process table
            assert d.curl("POST", "/v1/bind", {"pid": other.pid, "npu": 0})[0] == 200

            fake.answer()
            assert wait_for(lambda: d.client.health()["status"] == "ok", 60), d.log()[-2000:]
            status, body = d.curl("POST", "/v1/release", {"pid": other.pid})
            assert status == 200, body
            status, body = d.curl("POST", "/v1/bind", {"pid": w.pid})
            assert status == 200 and body["npus"] == [0], body
        assert fake.hung_runs() >= 1 and fake.wait_no_survivors() == []
    finally:
        d.stop()


def test_sighup_reloads_the_config_file_and_keeps_the_old_one_when_bad(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('reconcile_seconds = 1\ntopology_policy = "none"\n')
    argv = [sys.executable, "-m", "ascendbind.cli", "serve", "--config", str(cfg)]
    d = _daemon(tmp_path, argv=argv).start()
    try:
        with start_worker(plain=1, acl=0, release=0) as a, start_worker(plain=1, acl=0, release=0) as b:
            # the node names a policy: a request may repeat it, never contradict it
            status, body = d.curl("POST", "/v1/bind", {"pid": a.pid, "npu": 0, "topology_policy": "restricted"})
            assert status == 409 and body["error"] == "policy_mismatch", body
            assert metric_value(d.metrics_text(), "ascendbind_bind_requests_total", outcome="rejected") == 1
            assert d.curl("POST", "/v1/bind", {"pid": a.pid, "npu": 0, "topology_policy": "none"})[0] == 200
            assert d.curl("POST", "/v1/bind", {"pid": b.pid, "npu": 0})[0] == 409
            cfg.write_text("reconcile_seconds = 1\nallow_shared_npu = true\n")
            d.proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: "config reloaded" in d.log(), 5)
            assert d.curl("POST", "/v1/bind", {"pid": b.pid, "npu": 0})[0] == 200
            assert len(d.client.workers()["workers"]) == 2
            cfg.write_text("reconcile_seconds = 1\nno_such_key = 3\n")
            d.proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: "config not reloaded" in d.log(), 5)
            assert "no_such_key" in d.log() and d.client.health()["status"] == "ok"
    finally:
        d.stop()


def _tgkill(tgid: int, tid: int, sig: int) -> None:
    """Send ``sig`` to one thread of another process (tgkill(2)), as the kernel may itself."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    nr = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)
    if nr is None:
        pytest.skip(f"tgkill's number on {os.uname().machine} is not known here")
    if libc.syscall(nr, tgid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def test_a_signal_the_kernel_gives_another_thread_still_reloads_and_stops_the_daemon(tmp_path):
    """A process-directed signal may land on any thread; Python runs its handler in the
    main thread, which must not sleep through it (the wake-up pipe)."""
    d = _daemon(tmp_path).start()
    try:
        d.wait_discovered()
        others = sorted(int(t) for t in os.listdir(f"/proc/{d.pid}/task") if int(t) != d.pid)
        assert others
        _tgkill(d.pid, others[-1], signal.SIGHUP)
        assert wait_for(lambda: "SIGHUP: config reloaded" in d.log(), 10), d.log()
        _tgkill(d.pid, others[0], signal.SIGTERM)
        assert d.proc.wait(15) == 0
    finally:
        d.stop()


def test_auto_bind_binds_what_the_npu_smi_process_table_lists(tmp_path):
    with start_worker(plain=1, acl=1, release=1) as w:
        d = _daemon(tmp_path, ASCENDBIND_AUTO_BIND="true", ASCENDBIND_AUTO_BIND_SECONDS="1",
                    ASCENDBIND_FAKE_NPU_PIDS=str(w.pid)).start()
        try:
            assert wait_for(lambda: [x["pid"] for x in d.client.workers()["workers"]] == [w.pid], 10), d.log()
            worker = d.client.workers()["workers"][0]
            assert worker["npus"] == [0]
            acl = set(worker["plan"]["npus"]["0"]["acl"])
            acl_tid = w.tid_named("acl_thread")
            assert cpus_allowed_of(w.pid, acl_tid) == acl
        finally:
            d.stop()


def _unix_listening(path: str) -> bool:
    """True once a Unix socket bound to ``path`` is listening (``__SO_ACCEPTCON`` in /proc/net/unix)."""
    with open("/proc/net/unix") as fh:
        next(fh)
        for line in fh:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == path and int(fields[3], 16) & 0x10000:
                return True
    return False


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate missing")
def test_socket_activation_sd_notify_watchdog_and_journald_lines(tmp_path):
    sock_path = str(tmp_path / "activated.sock")
    notify_path = str(tmp_path / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(15)
    log_path = tmp_path / "daemon.log"
    log = open(log_path, "w")
    st = os.fstat(log.fileno())
    env = base_env(str(tmp_path / "unused.sock"), str(tmp_path / "state"), free_port())
    env.update(NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="1000000", JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
    argv = ["systemd-socket-activate", "-l", sock_path]
    for key in sorted(env):
        if key.startswith(("ASCENDBIND_", "NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM")) or key in ("PATH",
                                                                                                    "PYTHONPATH"):
            argv += ["-E", f"{key}={env[key]}"]
    argv += [sys.executable, "-m", "ascendbind.cli", "serve"]
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
    try:
        # the file exists from bind(); connecting is only safe once listen() has run
        assert wait_for(lambda: _unix_listening(sock_path), 10)
        from ascendbind.client import Client

        client = Client(sock_path, timeout=20)
        assert client.health()["status"] in ("ok", "degraded")  # the first connection starts the daemon
        messages = []
        while not any("WATCHDOG=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        assert any("READY=1" in m for m in messages), messages
        assert not os.path.exists(tmp_path / "unused.sock")  # it used systemd's socket, made none
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert os.path.exists(sock_path)  # systemd's socket is systemd's to remove
        text = log_path.read_text()
        # what systemd-socket-activate itself prints ends with its "Execing ..." line
        lines = [ln for ln in text[text.index("Execing"):].splitlines()[1:] if ln.strip()]
        assert lines and all(ln.startswith("<") for ln in lines), lines[:3]
        first = lines[0]
        assert first[1] in "01234567" and first[2] == ">" and json.loads(first[3:])["event"]
        assert any('"via": "systemd"' in ln for ln in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        notify.close()


def test_make_run_demo_binds_through_the_socket():
    r = subprocess.run([sys.executable, "-m", "ascendbind.demo"], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "before:" in r.stdout and "after:" in r.stdout and "released" in r.stdout
    late = [ln for ln in r.stdout.splitlines() if "acl_thread_2" in ln]
    # the fixture NPU's affinity is every CPU: its pool is aligned only on a one-node host,
    # and spans the nodes (unaligned) on a multi-node one
    outcome = "aligned" if len(nodes_with_cpus()) == 1 else "unaligned"
    assert late and f'ascendbind_bind_requests_total{{outcome="{outcome}"}} 1.0' in r.stdout


def test_a_demo_stopped_by_sigterm_leaves_neither_its_daemon_nor_its_worker():
    demo = subprocess.Popen([sys.executable, "-m", "ascendbind.demo"], stdout=subprocess.PIPE, text=True,
                            cwd=str(ROOT), env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        first = demo.stdout.readline()
        assert first.startswith("daemon pid "), first
        daemon_pid = int(first.split()[2])
        worker_pid = int(demo.stdout.readline().split()[3])
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(30) in (0, 128 + signal.SIGTERM)  # 0: it had ended by itself first
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
    for pid in (daemon_pid, worker_pid):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped by the demo: not even a zombie is left
