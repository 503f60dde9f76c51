"""Isolation on this machine's real IRQs and a real ``ascendbind serve``.

The fixture npu-smi describes this machine as two NPUs (affinity CPU 0 and CPU 1, the
lowest two CPUs the test may use; ``small_pool = share``): a worker bound on NPU 1
protects NPU 1's main, ACL and release CPUs, and NPU 0's IRQ CPU is housekeeping. At
``irqs`` every IRQ whose mask the kernel lets us write must leave the protected CPUs,
and release, stop, ``kill -9`` plus a restart and SIGHUP to ``off`` must put every mask
back byte for byte; at ``off`` nothing on the host may change. The daemon's own threads
(read from ``/proc/<daemon>/task/*/status``) and a tool it runs keep off the protected
CPUs at every level. ``host`` moves other processes: it is tested in a pid namespace of
its own (tests/test_isolation_host.py), never here.

irqbalance is ``warn`` here: other test sessions on this machine may run an
irqbalance of their own, which a daemon at ``ban`` would tell about our CPUs
(tests/test_isolation_keeper.py talks to a real one of its own). Each test puts back
every IRQ mask, the default mask and the workqueue masks, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ascendbind.values.cpulist import format_mask, parse_cpulist, parse_mask
from tests.builders import write_once
from tests.daemon_harness import FIXTURE_BIN, DaemonProc, base_env, free_port, wait_for
from tests.deploy_tools import in_ci
from tests.irqbalance_harness import irq_masks_lock
from tests.workers import cpus_allowed_of, start_worker

N_CPUS = len(os.sched_getaffinity(0))
STARTED_ON = frozenset(os.sched_getaffinity(0))
# the two NPUs' CPUs: the lowest two this test may use (CPU 0 and CPU 1 on most machines)
NPU_CPUS = ";".join(map(str, sorted(STARTED_ON)[:2]))


def _need_real_irqs() -> None:
    why = None
    if os.geteuid() != 0 or not os.access("/proc/irq", os.W_OK):
        why = "needs root and a writable /proc/irq"
    elif N_CPUS < 2:
        why = "needs two CPUs: one to protect, one for the rest of the host"
    if why:
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)


# ---------------------------------------------------------------- the host's masks


WATCHDOG = "/proc/sys/kernel/watchdog_cpumask"


def host_masks() -> dict[str, str]:
    """Every IRQ's mask, the default for new IRQs, every workqueue mask and the soft-lockup
    watchdog's CPUs, as text."""
    out = {}
    for name in os.listdir("/proc/irq"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                out[f"irq:{name}"] = Path(f"/proc/irq/{name}/smp_affinity").read_text().strip()
    out["default"] = Path("/proc/irq/default_smp_affinity").read_text().strip()
    wq = Path("/sys/devices/virtual/workqueue")
    for path in [wq / "cpumask", *wq.glob("*/cpumask")]:
        with contextlib.suppress(OSError):
            out[f"wq:{path.relative_to(wq)}"] = path.read_text().strip()
    with contextlib.suppress(OSError):
        out["watchdog"] = Path(WATCHDOG).read_text().strip()
    return out


def _path(key: str) -> str:
    kind, _, rest = key.partition(":")
    return {"irq": f"/proc/irq/{rest}/smp_affinity", "default": "/proc/irq/default_smp_affinity",
            "wq": f"/sys/devices/virtual/workqueue/{rest}", "watchdog": WATCHDOG}[kind]


def put_back(saved: dict[str, str]) -> None:
    for key, text in saved.items():
        with contextlib.suppress(OSError):
            if Path(_path(key)).read_text().strip() != text:
                write_once(_path(key), text)


@pytest.fixture
def masks():
    """The host's masks before the test; every one is put back afterwards, whatever happened.
    No other test that changes and restores them runs meanwhile (irq_masks_lock)."""
    _need_real_irqs()
    with irq_masks_lock():
        saved = host_masks()
        try:
            yield saved
        finally:
            put_back(saved)


def changed(before: dict[str, str]) -> dict[str, tuple[str, str]]:
    now = host_masks()
    return {k: (before.get(k), v) for k, v in now.items() if before.get(k) != v}


# ---------------------------------------------------------------- the daemon


@contextlib.contextmanager
def daemon(**env: str):
    directory = tempfile.mkdtemp(prefix="ascendbind-iso-", dir="/tmp")
    env = {"ASCENDBIND_FAKE_NPUS": "2", "ASCENDBIND_FAKE_NPU_AFFINITY": NPU_CPUS, "ASCENDBIND_IRQBALANCE": "warn",
           **env}
    full = base_env(os.path.join(directory, "ascendbind.sock"), os.path.join(directory, "state"), free_port(), **env)
    d = DaemonProc(directory, full)
    try:
        d.start()
        d.wait_discovered()
        yield d
    finally:
        d.stop()
        shutil.rmtree(directory, ignore_errors=True)


def restart(d: DaemonProc) -> DaemonProc:
    again = DaemonProc(d.dir, d.env)
    again.start()
    again.wait_discovered()
    return again


def isolation(d: DaemonProc) -> dict:
    return d.client.workers()["isolation"]


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        cpus = cpus_allowed_of(pid, int(tid))
        if cpus is not None:
            out[int(tid)] = cpus
    return out


def bind(d: DaemonProc, pid: int, npu: int = 1) -> dict:
    status, body = d.curl("POST", "/v1/bind", {"pid": pid, "npu": npu})
    assert status == 200, body
    return body


def skipped_irqs(iso: dict) -> set[str]:
    return {s["what"] for s in iso["skipped"]}


def assert_off_the_protected_cpus(iso: dict) -> None:
    protected = parse_cpulist(iso["protected"])
    assert protected and iso["housekeeping"] and iso["error"] is None, iso
    masks_now = host_masks()
    pinned_or_refused = skipped_irqs(iso)
    on_protected = {k: v for k, v in masks_now.items() if k.startswith("irq:") and k not in pinned_or_refused
                    and parse_mask(v) & protected}
    assert not on_protected, f"IRQs still allowed on {iso['protected']}: {on_protected}"
    assert not parse_mask(masks_now["default"]) & protected


# ---------------------------------------------------------------- off


def test_off_changes_nothing_on_the_host_but_keeps_the_daemon_and_its_tools_off_the_bound_cpus(masks, tmp_path):
    log = tmp_path / "npu-smi-cpus"
    wrapper = tmp_path / "npu-smi"
    wrapper.write_text(f"#!/bin/sh\ngrep Cpus_allowed_list /proc/self/status >> {log}\n"
                       f"exec {FIXTURE_BIN / 'npu-smi'} \"$@\"\n")
    wrapper.chmod(0o755)
    with daemon(ASCENDBIND_NPU_SMI=str(wrapper)) as d, start_worker() as w:
        before_threads = thread_cpus(d.pid)
        assert set(before_threads.values()) == {STARTED_ON}
        bind(d, w.pid)
        iso = isolation(d)
        housekeeping = parse_cpulist(iso["housekeeping"])
        assert iso["level"] == "off" and housekeeping and iso["protected"]
        assert set(thread_cpus(d.pid).values()) == {housekeeping}
        assert iso["daemon_threads"]["cpus"] == iso["housekeeping"]
        # a tool the daemon runs now, and a thread it starts now (SIGHUP: a rediscovery thread
        # that runs npu-smi), start on the housekeeping CPUs too
        log.write_text("")
        d.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: log.read_text().strip(), 30), d.log()
        assert {parse_cpulist(line.split(":")[1]) for line in log.read_text().splitlines()} == {housekeeping}
        assert wait_for(lambda: "SIGHUP: config reloaded" in d.log(), 30)
        assert set(thread_cpus(d.pid).values()) == {housekeeping}
        assert changed(masks) == {}  # nothing else moved: IRQs, the default, the workqueues
        status, _ = d.curl("POST", "/v1/release", {"pid": w.pid})
        assert status == 200
        assert set(thread_cpus(d.pid).values()) == {STARTED_ON}
        assert changed(masks) == {}
        assert json.loads(Path(d.state_dir, "state.json").read_text()).get("isolation") is None


# ---------------------------------------------------------------- irqs


def test_irqs_moves_every_other_irq_off_the_bound_cpus_and_release_puts_each_back(masks):
    with daemon(ASCENDBIND_ISOLATION="irqs") as d, start_worker() as w:
        bind(d, w.pid)
        iso = isolation(d)
        assert_off_the_protected_cpus(iso)
        moved = {k for k in changed(masks) if k.startswith("irq:")}
        assert moved and iso["changed"]["irq"] == len(moved) and iso["changed"]["default"] == 1
        assert all(s["reason"] in ("irq_unchangeable",) for s in iso["skipped"]), iso["skipped"]
        for key in skipped_irqs(iso):  # a managed IRQ: refused by the kernel, left as it was
            assert host_masks()[key] == masks[key]
        # every changed mask is in the state file with the text it had
        record = json.loads(Path(d.state_dir, "state.json").read_text())["isolation"]["masks"]
        assert {k: v["original"] for k, v in record.items()} == {k: masks[k] for k in record}
        assert set(record) == moved | {"default"}
        assert set(thread_cpus(d.pid).values()) == {parse_cpulist(iso["housekeeping"])}
        # what an operator reads: the level, CPU by CPU, where the daemon is, what was skipped
        out = subprocess.run([sys.executable, "-m", "ascendbind", "status", "--socket", d.sock], capture_output=True,
                             text=True, env=d.env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"isolation: irqs  housekeeping {iso['housekeeping']} (auto)  protected {iso['protected']}" in out.stdout
        assert f"irq {len(moved)}, default 1" in out.stdout and "protected     NPU 1 main" in out.stdout
        assert f"daemon threads on CPUs {iso['housekeeping']}" in out.stdout
        assert all(f"[{s['reason']}]" in out.stdout for s in iso["skipped"])
        # bound again: a refused IRQ is still listed, and not tried again
        d.curl("POST", "/v1/release", {"pid": w.pid})
        bind(d, w.pid)
        assert skipped_irqs(isolation(d)) == skipped_irqs(iso)
        status, _ = d.curl("POST", "/v1/release", {"pid": w.pid})
        assert status == 200
        assert changed(masks) == {}, "release must put every mask back byte for byte"
        assert isolation(d)["changed"] == {"irq": 0, "default": 0, "workqueue": 0, "workqueues": 0, "watchdog": 0, "task": 0}
        assert set(thread_cpus(d.pid).values()) == {STARTED_ON}


def test_stop_puts_back_and_a_restart_sets_again_for_the_workers_it_keeps(masks):
    with daemon(ASCENDBIND_ISOLATION="irqs") as d, start_worker() as w:
        bind(d, w.pid)
        narrowed = host_masks()
        assert changed(masks)
        assert d.stop() == 0
        assert changed(masks) == {}, "stop must put every mask back"
        assert "isolation put the host back" in d.log() and "could not put" not in d.log()
        assert cpus_allowed_of(w.pid, w.pid) != STARTED_ON or N_CPUS == 1  # the binding stays
        d2 = restart(d)
        try:
            assert wait_for(lambda: host_masks() == narrowed, 15), changed(narrowed)
            d2.curl("POST", "/v1/release", {"pid": w.pid})
            assert changed(masks) == {}
        finally:
            d2.stop()


def test_a_restart_after_kill_9_puts_back_what_the_killed_daemon_changed(masks):
    with daemon(ASCENDBIND_ISOLATION="irqs") as d:
        with start_worker() as w:
            bind(d, w.pid)
            assert changed(masks)
            d.proc.kill()
            d.proc.wait(10)
            assert changed(masks), "a killed daemon leaves its masks"
        # the worker is gone too: the next daemon owes the host every mask
        d2 = restart(d)
        try:
            assert wait_for(lambda: not changed(masks), 15), changed(masks)
            assert "isolation" not in json.loads(Path(d2.state_dir, "state.json").read_text())
        finally:
            d2.stop()


def test_a_restart_after_kill_9_with_the_worker_alive_keeps_isolating_then_release_puts_back(masks):
    with daemon(ASCENDBIND_ISOLATION="irqs") as d, start_worker() as w:
        bind(d, w.pid)
        narrowed = host_masks()
        d.proc.kill()
        d.proc.wait(10)
        d2 = restart(d)
        try:
            assert host_masks() == narrowed and isolation(d2)["changed"]["irq"] > 0
            status, _ = d2.curl("POST", "/v1/release", {"pid": w.pid})
            assert status == 200 and changed(masks) == {}, d2.log()[-6000:]
        finally:
            d2.stop()


def test_sighup_to_off_puts_back_and_back_to_irqs_moves_again(masks, tmp_path):
    conf = tmp_path / "config.toml"
    conf.write_text('isolation = "irqs"\n')
    with daemon(ASCENDBIND_CONFIG=str(conf)) as d, start_worker() as w:
        bind(d, w.pid)
        narrowed = host_masks()
        conf.write_text('isolation = "off"\n')
        d.proc.send_signal(signal.SIGHUP)
        if not wait_for(lambda: isolation(d)["level"] == "off" and not changed(masks), 15):
            pytest.fail(f"not put back after SIGHUP to off: {changed(masks)}\n{d.log()}")
        conf.write_text('isolation = "irqs"\n')
        d.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: host_masks() == narrowed, 15), changed(narrowed)
        d.curl("POST", "/v1/release", {"pid": w.pid})
        assert changed(masks) == {}


def test_a_mask_its_owner_changed_meanwhile_is_left_and_said(masks):
    with daemon(ASCENDBIND_ISOLATION="irqs") as d, start_worker() as w:
        bind(d, w.pid)
        iso = isolation(d)
        protected = parse_cpulist(iso["protected"])
        key = sorted(k for k in changed(masks) if k.startswith("irq:"))[0]
        theirs = format_mask(protected)  # neither its original nor what isolation wrote
        write_once(_path(key), theirs)
        owner_now = host_masks()[key]
        d.curl("POST", "/v1/release", {"pid": w.pid})
        assert changed(masks) == {key: (masks[key], owner_now)}
        left = isolation(d)["left_to_owner"]
        assert [e["what"] for e in left] == [key] and left[0]["reason"] == "changed_by_owner"
        assert "changed by its owner meanwhile" in d.log()


def test_no_housekeeping_cpu_refuses_the_bind_and_changes_nothing(masks):
    # one NPU over every CPU: its release CPU is the last one; naming it alone as housekeeping
    # leaves nothing once a worker is bound there
    last = max(STARTED_ON)
    with daemon(ASCENDBIND_ISOLATION="irqs", ASCENDBIND_FAKE_NPUS="1", ASCENDBIND_FAKE_NPU_AFFINITY="",
                ASCENDBIND_HOUSEKEEPING_CPUS=str(last)) as d, start_worker() as w:
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 422 and body["error"] == "no_housekeeping_cpus", body
        assert "no housekeeping CPU is left" in body["detail"] and f"housekeeping_cpus = {last}" in body["detail"]
        assert set(w.cpus_allowed().values()) == {STARTED_ON}
        assert changed(masks) == {}
        assert d.client.workers()["workers"] == []


def test_an_unwritable_state_file_stops_isolation_before_any_mask(masks):
    with daemon(ASCENDBIND_ISOLATION="irqs") as d, start_worker() as w:
        os.chmod(d.state_dir, 0o777)  # no longer safe for root's state: the daemon writes nothing there
        try:
            bind(d, w.pid)
            assert changed(masks) == {}, "a mask changed with no record of its original on disk"
            assert "could not write the state file" in d.log()
        finally:
            os.chmod(d.state_dir, 0o700)
        d.curl("POST", "/v1/release", {"pid": w.pid})
        assert changed(masks) == {}
