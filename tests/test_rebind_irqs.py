"""A held worker bound again to other NPUs gives the host back what it saved for the NPUs
it left, as a release of those NPUs would: their IRQ masks, byte for byte, unless a live
worker still shares that NPU (then they stay with it, for whichever leaves last).

A real daemon binds real workers in a mount namespace of its own, where
/proc/interrupts names four real IRQs of this machine as the SQ/CQ vectors of two
fixture NPUs (the fixture npu-smi lists two); the masks are this machine's
/proc/irq/<n>/smp_affinity, put back whatever the test comes to. The rule itself
(lifecycle.left_behind) is table-tested in test_lifecycle_rules.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ascendbind.discovery.gather.irqhost import read_irq_mask
from ascendbind.values.cpulist import parse_cpulist, parse_mask
from tests.daemon_harness import PATIENCE, DaemonProc, base_env, free_port
from tests.irqbalance_harness import irq_masks_lock, restore_irq_masks as put_back_irq_masks
from tests.daemon_harness import wait_for
from tests.test_write_ahead import _changeable_irqs, _stopped
from tests.workers import start_worker

pytestmark = [
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a binding on one CPU changes no mask"),
    pytest.mark.skipif(os.geteuid() != 0 or not os.access("/proc/irq", os.W_OK), reason="needs root and /proc/irq"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)"),
]

# where the fixture npu-smi puts NPUs 0 and 1 (ASCENDBIND_FAKE_NPUS=2): addresses this machine lacks
NPU_PCI = ("0000:c1:00.0", "0000:c2:00.0")


def _two_npu_host(directory: Path, irqs: list[int]) -> tuple[Path, Path]:
    """(sys_root, interrupts): NPU 0's MSI vectors are irqs[0:2], NPU 1's irqs[2:4]."""
    sys_root = directory / "sys"
    cpus = "".join(f"{'CPU' + str(c):>11}" for c in range(os.cpu_count() or 1))
    zeros = "".join(f"{0:>11}" for _ in range(os.cpu_count() or 1))
    rows = [cpus]
    for npu, pci in enumerate(NPU_PCI):
        msi = sys_root / "bus" / "pci" / "devices" / pci / "msi_irqs"
        msi.mkdir(parents=True)
        (msi.parent / "numa_node").write_text("-1\n")
        sq, cq = irqs[2 * npu], irqs[2 * npu + 1]
        for irq in (sq, cq):
            (msi / str(irq)).write_text("msix\n")
        rows.append(f"{sq:>4}:{zeros}   ITS-MSI {1049600 + 4 * npu} Edge      sq_send_trigger_irq")
        rows.append(f"{cq:>4}:{zeros}   ITS-MSI {1049601 + 4 * npu} Edge      cq_update_irq")
    for name in os.listdir("/sys"):
        if name != "bus":
            (sys_root / name).symlink_to(f"/sys/{name}")
    interrupts = directory / "interrupts"
    interrupts.write_text("\n".join(rows) + "\n")
    return sys_root, interrupts


def _daemon(tmp_path: Path, sys_root: Path, interrupts: Path, **extra: str) -> DaemonProc:
    """A daemon in a mount namespace of its own, where /proc/interrupts is ``interrupts``."""
    env = base_env(str(tmp_path / "ascendbind.sock"), str(tmp_path / "state"), free_port(),
                   ASCENDBIND_SYS_ROOT=str(sys_root), ASCENDBIND_FAKE_NPUS="2",
                   ASCENDBIND_IRQBALANCE="warn", **extra)  # never tell an irqbalance some other test runs
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /proc/interrupts && exec "$@"', str(interrupts),
            sys.executable, "-m", "ascendbind.cli", "serve"]
    d = DaemonProc(str(tmp_path), env, argv)
    d.start(wait=False)
    try:
        d.wait_ready(60 * PATIENCE)
        d.wait_discovered(60 * PATIENCE)
    except BaseException:
        d.stop()
        raise
    return d


def _bind(d: DaemonProc, pid: int, npu: int) -> dict:
    status, body = d.curl("POST", "/v1/bind", {"pid": pid, "npu": npu})
    assert status == 200, body
    answer = json.loads(body) if isinstance(body, str) else body
    assert answer["npus"] == [npu], answer
    return answer


def _irq_cpus(answer: dict, npu: int) -> frozenset[int]:
    irq = answer["plan"]["npus"][str(npu)]["irq"]
    return frozenset(irq) if isinstance(irq, list) else parse_cpulist(irq)


def _now(irqs) -> dict[int, str]:
    return {irq: read_irq_mask(irq) for irq in irqs}


def _with_real_irqs(test) -> None:
    with irq_masks_lock():
        irqs = _changeable_irqs(4)
        originals = _now(irqs)
        try:
            test(irqs, originals)
        finally:
            put_back_irq_masks(originals)


def test_rebind_to_another_npu_gives_the_left_npus_irq_masks_back(tmp_path):
    def test(irqs, originals):
        npu0, npu1 = irqs[:2], irqs[2:]
        sys_root, interrupts = _two_npu_host(tmp_path, irqs)
        with start_worker(plain=4, acl=1, release=1) as w:
            d = _daemon(tmp_path, sys_root, interrupts)
            try:
                first = _bind(d, w.pid, 0)
                cpus0 = _irq_cpus(first, 0)
                assert {i: parse_mask(m) for i, m in _now(npu0).items()} == {i: cpus0 for i in npu0}
                assert cpus0 != parse_mask(originals[npu0[0]]), "the plan's IRQ CPUs must differ to see a restore"

                second = _bind(d, w.pid, 1)
                assert _now(npu0) == {i: originals[i] for i in npu0}, d.log()[-3000:]  # byte for byte
                cpus1 = _irq_cpus(second, 1)
                assert {i: parse_mask(m) for i, m in _now(npu1).items()} == {i: cpus1 for i in npu1}
                [rec] = [r for r in json.loads((tmp_path / "state" / "state.json").read_text())["workers"]
                         if r["pid"] == w.pid]
                assert rec["saved_irq_masks"] == {str(i): originals[i] for i in npu1}  # only its own NPU's

                d.client.release(w.pid)
                assert _now(irqs) == originals
            finally:
                d.stop()

    _with_real_irqs(test)


def test_rebind_leaves_the_irq_masks_of_an_npu_a_live_sharer_still_drives(tmp_path):
    def test(irqs, originals):
        npu0, npu1 = irqs[:2], irqs[2:]
        sys_root, interrupts = _two_npu_host(tmp_path, irqs)
        with start_worker(plain=4, acl=1, release=1) as a, start_worker(plain=4, acl=1, release=1) as b:
            d = _daemon(tmp_path, sys_root, interrupts, ASCENDBIND_ALLOW_SHARED_NPU="true")
            try:
                _bind(d, a.pid, 0)
                shared = _bind(d, b.pid, 0)
                cpus0 = _now(npu0)
                assert {i: parse_mask(m) for i, m in cpus0.items()} == {i: _irq_cpus(shared, 0) for i in npu0}

                _bind(d, a.pid, 1)
                assert _now(npu0) == cpus0, d.log()[-3000:]  # b still drives NPU 0: its IRQs stay put
                assert _now(npu1) != {i: originals[i] for i in npu1}

                d.client.release(b.pid)  # the last on NPU 0 gives the host its masks back
                assert _now(npu0) == {i: originals[i] for i in npu0}, d.log()[-3000:]
                d.client.release(a.pid)
                assert _now(irqs) == originals
            finally:
                d.stop()

    _with_real_irqs(test)


def _stopped_bind(d: DaemonProc, pid: int, npu: int) -> subprocess.Popen:
    """A bind request sent in the background; returns once the daemon stopped itself in it."""
    proc = subprocess.Popen(["curl", "-sS", "--max-time", str(60 * PATIENCE), "--unix-socket", d.sock,
                             "-X", "POST", "-H", "Content-Type: application/json",
                             "--data-binary", json.dumps({"pid": pid, "npu": npu}), "http://localhost/v1/bind"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_for(lambda: _stopped(d.pid), 30 * PATIENCE), d.log()[-3000:]
    return proc


def test_kill_9_among_a_rebinds_writes_gives_both_npus_masks_back_at_restart(tmp_path):
    """Killed after the re-bind wrote NPU 1's masks, before it gave NPU 0's back: the in-flight
    record, which replaced the first binding's, carries NPU 0's saved masks too, so the next
    daemon's undo restores both NPUs'."""
    def test(irqs, originals):
        npu0, npu1 = irqs[:2], irqs[2:]
        sys_root, interrupts = _two_npu_host(tmp_path, irqs)
        with start_worker(plain=4, acl=1, release=1) as w:
            d = _daemon(tmp_path, sys_root, interrupts, ASCENDBIND_TEST_STOP_AT="written")
            first = second = None
            try:
                first = _stopped_bind(d, w.pid, 0)
                os.kill(d.pid, signal.SIGCONT)
                assert first.wait(timeout=60 * PATIENCE) == 0
                assert _now(npu0) != {i: originals[i] for i in npu0}
                second = _stopped_bind(d, w.pid, 1)
                [rec] = [r for r in json.loads((tmp_path / "state" / "state.json").read_text())["workers"]
                         if r["pid"] == w.pid]
                assert rec["in_flight"] is True and rec["npus"] == [1]
                assert rec["saved_irq_masks"] == {str(i): originals[i] for i in irqs}
                os.kill(d.pid, signal.SIGKILL)
            finally:
                d.stop()
                for proc in (first, second):
                    if proc is not None:
                        proc.kill()
                        proc.wait(timeout=10)
            d2 = _daemon(tmp_path, sys_root, interrupts)
            try:
                assert w.pid not in [x["pid"] for x in d2.client.workers()["workers"]]
                assert _now(irqs) == originals, d2.log()[-3000:]
            finally:
                d2.stop()

    _with_real_irqs(test)
