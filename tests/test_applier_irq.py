"""The IRQ step: /proc/interrupts parsing, SQ/CQ choice and mask writes on a fixture
/proc + /sys tree (regular files), plus one real write-back and the real
"unchangeable" path on this machine's /proc/irq."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import textwrap

import pytest

from ascendbind.applier.irq import (bind_irqs, bind_npu_irqs, prepare_npu_irqs, restore_irq_masks, set_irq_affinity,
                                   with_planned_irqs)
from ascendbind.values.config import Config
from ascendbind.values.cpulist import parse_mask
from ascendbind.values.decisions import IrqBinding
from ascendbind.discovery.gather.irqhost import irqbalance_pids, read_irq_mask
from ascendbind.discovery.parse.irqs import parse_interrupts
from ascendbind.discovery import LiveHost
from ascendbind.errors import ParseError
from tests.irqbalance_harness import irq_masks_lock, restore_irq_masks as put_back_irq_masks
from tests.planner_hosts import one_npu_host
from ascendbind.values.model import (
    DeviceType,
    HostFacts,
    Mode,
    NpuPlan,
    Plan,
)
from ascendbind.values.reasons import Outcome, Reason

PCI = "0000:c1:00.0"
INTERRUPTS = textwrap.dedent(
    """\
               CPU0       CPU1       CPU2       CPU3
      9:          0          0          0          0   IO-APIC   9-fasteoi   acpi
     16:          3          0          0          0   IO-APIC  16-fasteoi   ehci_hcd:usb1, uhci_hcd:usb2
    500:          0          0          0          0   ITS-MSI 1049000 Edge      sq_send_trigger_irq
    423:          0          0          0          0   ITS-MSI 1049603 Edge      sq_send_trigger_irq
    420:          0          0          0          0   ITS-MSI 1049600 Edge      sq_send_trigger_irq
    421:          0          0          0          0   ITS-MSI 1049601 Edge      cq_update_irq
    424:          0          0          0          0   ITS-MSI 1049604 Edge      cq_update_irq
    NMI:          0          0          0          0   Non-maskable interrupts
    LOC:      17894      17802      17000      17001   Local timer interrupts
    ERR:          0
    """
)


# ---------------------------------------------------------------- parser


def test_parse_interrupts_rows_in_printed_order():
    rows = parse_interrupts(INTERRUPTS)
    assert rows == (
        (9, "acpi"),
        (16, "ehci_hcd:usb1, uhci_hcd:usb2"),
        (500, "sq_send_trigger_irq"),
        (423, "sq_send_trigger_irq"),
        (420, "sq_send_trigger_irq"),
        (421, "cq_update_irq"),
        (424, "cq_update_irq"),
    )


def test_parse_interrupts_of_this_machine():
    with open("/proc/interrupts") as fh:
        rows = parse_interrupts(fh.read())
    assert rows and all(isinstance(i, int) and name for i, name in rows)


@pytest.mark.parametrize(
    "bad, line",
    [
        ("           CPU0       CPU1\n 42:  0  Edge  x\n", 2),  # one count, two CPUs
        ("           CPU0\n 42:\n", 2),  # nothing after the colon
        ("           CPU0\n 42:  7\n", 2),  # no name
        ("           CPU0\n 42   7  Edge  x\n", 2),  # no colon
    ],
)
def test_parse_interrupts_malformed_names_source_and_line(bad, line):
    with pytest.raises(ParseError) as exc:
        parse_interrupts(bad)
    assert "/proc/interrupts" in str(exc.value) and f"line {line}" in str(exc.value)


# ---------------------------------------------------------------- fixture tree


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path)


def make_tree(tmp_path):
    """A /proc + /sys fixture: NPU 0 at PCI owns MSI IRQs 420-424; 500 is another device's."""
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    (proc / "irq").mkdir(parents=True)
    (proc / "interrupts").write_text(INTERRUPTS)
    for irq in (9, 16, 420, 421, 422, 423, 424, 500):
        (proc / "irq" / str(irq)).mkdir()
        (proc / "irq" / str(irq) / "smp_affinity").write_text("f\n")
    msi = sys_ / "bus" / "pci" / "devices" / PCI / "msi_irqs"
    msi.mkdir(parents=True)
    for irq in (420, 421, 422, 423, 424):
        (msi / str(irq)).write_text("msi\n")
    return proc, sys_


def cfg(tree, **kw) -> Config:
    proc, sys_ = tree
    return Config(proc_root=str(proc), sys_root=str(sys_), **kw)


def host(pci=PCI) -> HostFacts:
    return one_npu_host({0: frozenset(range(4))}, pci={0: pci} if pci else None)


def plan(irq=(2, 3), mode=Mode.TOPO_AFFINITY) -> Plan:
    npu = NpuPlan(0, (2, 3, 0, 1, 4), irq, (0,), (1,), (4,), (0,))
    return Plan(mode, DeviceType.A2, None, (0, 1, 2, 3, 4), (npu,))


def mask(tree, irq) -> str:
    return (tree[0] / "irq" / str(irq) / "smp_affinity").read_text().strip()


def test_first_sq_of_the_npu_in_interrupts_order_and_first_cq(tree):
    res = bind_irqs(plan(), host(), cfg(tree))
    assert res.outcome is Outcome.APPLIED and res.reason is None, res.detail
    # 500 belongs to another device; 423 precedes 420 in /proc/interrupts
    assert mask(tree, 423) == "00000004"  # irq[0] = CPU 2
    assert mask(tree, 421) == "00000008"  # irq[1] = CPU 3
    assert mask(tree, 420) == "f" and mask(tree, 500) == "f"
    assert dict(res.data["previous"]) == {423: "f", 421: "f"}
    npu = res.data["npus"][0]
    assert (npu["sq"], npu["cq"], npu["cq_guessed"]) == (423, 421, False)
    assert res.data["irqbalance"] == "not running"


def test_the_writes_come_back_as_typed_values_beside_the_report(tree):
    step = bind_npu_irqs(plan(), host(), cfg(tree))
    assert step.bindings == (IrqBinding(0, 423, frozenset({2}), "f", "ok", "00000004"),
                             IrqBinding(0, 421, frozenset({3}), "f", "ok", "00000008"))
    assert dict(step.saved) == {423: "f", 421: "f"} == dict(step.result.data["previous"])
    assert step.bans is None and step.result.outcome is Outcome.APPLIED
    # the same IRQs `plan` shows for this NPU, read through the same discovery
    shown = with_planned_irqs(plan(), host(), cfg(tree), LiveHost.from_config(cfg(tree))).irqs[0]
    assert [(irq, cpus) for irq, cpus in shown.moves] == [(b.irq, b.cpus) for b in step.bindings]


def test_the_step_is_decided_and_its_masks_read_before_any_write(tree):
    prep = prepare_npu_irqs(plan(), host(), cfg(tree))
    assert prep.skipped is None and dict(prep.originals) == {423: "f", 421: "f"}
    assert mask(tree, 423) == "f" and mask(tree, 421) == "f"  # read only
    (tree[0] / "irq" / "423" / "smp_affinity").write_text("1\n")  # moved by someone meanwhile
    step = bind_npu_irqs(plan(), host(), cfg(tree), prepared=prep)
    # exactly the IRQs prepared are written, each read again right before its write
    assert [(b.irq, b.previous) for b in step.bindings] == [(423, "1"), (421, "f")]
    assert mask(tree, 423) == "00000004" and mask(tree, 421) == "00000008"
    off = prepare_npu_irqs(plan(), host(), cfg(tree, irq_binding=False))
    assert off.skipped is not None and not off.originals
    assert bind_npu_irqs(plan(), host(), cfg(tree, irq_binding=False), prepared=off).result == off.skipped


def test_release_writes_the_saved_masks_back(tree):
    res = bind_irqs(plan(), host(), cfg(tree))
    back = restore_irq_masks(res.data["previous"], proc_root=str(tree[0]))
    assert back.outcome is Outcome.APPLIED
    assert mask(tree, 423) == "f" and mask(tree, 421) == "f"


def test_cq_is_the_irq_after_sq_only_when_no_cq_name_is_printed(tree):
    text = INTERRUPTS.replace("cq_update_irq", "something_else")
    (tree[0] / "interrupts").write_text(text)
    res = bind_irqs(plan(), host(), cfg(tree))
    npu = res.data["npus"][0]
    assert (npu["sq"], npu["cq"], npu["cq_guessed"]) == (423, 424, True)
    assert mask(tree, 424) == "00000008"


def test_one_irq_cpu_takes_both_sq_and_cq(tree):
    bind_irqs(plan(irq=(1,)), host(), cfg(tree))
    assert mask(tree, 423) == mask(tree, 421) == "00000002"


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"the_plan": plan(mode=Mode.ASCEND950_CLUSTER)}, Reason.NOT_APPLICABLE),
        ({"config": {"irq_binding": False}}, Reason.IRQ_BINDING_DISABLED),
        ({"facts": host(pci=None)}, Reason.NO_PCI_ADDRESS),
        ({"facts": host(pci="0000:c2:00.0")}, Reason.NO_MSI_IRQS),
        ({"the_plan": plan(irq=())}, Reason.NO_IRQ_CPUS),
    ],
)
def test_skips_with_the_seed_reasons(tree, kwargs, reason):
    res = bind_irqs(kwargs.get("the_plan", plan()), kwargs.get("facts", host()), cfg(tree, **kwargs.get("config", {})))
    assert res.outcome is Outcome.SKIPPED and res.reason is reason, res.detail
    assert mask(tree, 423) == "f"


def test_no_sq_name_in_the_npus_set(tree):
    (tree[0] / "interrupts").write_text(INTERRUPTS.replace("sq_send_trigger_irq", "other"))
    res = bind_irqs(plan(), host(), cfg(tree))
    assert res.reason is Reason.NO_SQ_IRQ


def test_malformed_interrupts_skips_and_names_the_line(tree):
    (tree[0] / "interrupts").write_text(INTERRUPTS + "777:  1\n")
    res = bind_irqs(plan(), host(), cfg(tree))
    assert res.outcome is Outcome.SKIPPED and res.reason is Reason.INTERRUPTS_UNREADABLE
    assert "/proc/interrupts line" in res.detail


needs_chattr = pytest.mark.skipif(
    shutil.which("chattr") is None or os.geteuid() != 0, reason="needs root and chattr (e2fsprogs)"
)


@contextlib.contextmanager
def immutable(path):
    """chattr +i: root's writes then fail with EPERM, the way the kernel rejects managed IRQs."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip(f"chattr +i not supported on {path}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@needs_chattr
def test_proc_irq_not_writable(tree):
    with immutable(tree[0] / "irq"):
        res = bind_irqs(plan(), host(), cfg(tree))
    assert res.outcome is Outcome.SKIPPED and res.reason is Reason.IRQ_NOT_WRITABLE


@needs_chattr
def test_eperm_is_unchangeable_skipped_not_retried(tree):
    with immutable(tree[0] / "irq" / "423" / "smp_affinity"):
        res = bind_irqs(plan(), host(), cfg(tree))
    # CQ went through, SQ is unchangeable: applied, and says so
    assert res.outcome is Outcome.APPLIED and res.reason is Reason.IRQ_UNCHANGEABLE
    writes = {w["irq"]: w["status"] for w in res.data["npus"][0]["writes"]}
    assert writes == {423: "unchangeable", 421: "ok"}
    assert dict(res.data["previous"]) == {421: "f"}  # only what we changed is restored
    with immutable(tree[0] / "irq" / "423" / "smp_affinity"):
        step = bind_npu_irqs(plan(), host(), cfg(tree))
    assert [(b.irq, b.status, b.changed) for b in step.bindings] == [(423, "unchangeable", False), (421, "ok", True)]
    with immutable(tree[0] / "irq" / "423" / "smp_affinity"), immutable(tree[0] / "irq" / "421" / "smp_affinity"):
        res = bind_irqs(plan(), host(), cfg(tree))
    assert res.outcome is Outcome.SKIPPED and res.reason is Reason.IRQ_UNCHANGEABLE


def test_irqbalance_running_is_reported_with_warn(tree):
    (tree[0] / "77").mkdir()
    (tree[0] / "77" / "comm").write_text("irqbalance\n")
    assert irqbalance_pids(str(tree[0])) == [77]
    res = bind_irqs(plan(), host(), cfg(tree, irqbalance="warn"))
    assert res.outcome is Outcome.APPLIED and res.reason is Reason.IRQBALANCE_ACTIVE
    assert res.data["irqbalance"] == "running" and "irqbalance" in res.detail


def test_irqbalance_that_cannot_be_told_still_gets_the_masks_written(tree):
    # a comm file and nothing else: no stat, no socket of that pid (the default is ban)
    (tree[0] / "77").mkdir()
    (tree[0] / "77" / "comm").write_text("irqbalance\n")
    res = bind_irqs(plan(), host(), cfg(tree))
    assert res.outcome is Outcome.APPLIED and res.reason is Reason.IRQBALANCE_UNREACHABLE, res.detail
    assert res.data["irqbalance"] == "unreachable" and "irqbalance_bans" not in res.data
    assert "pid 77" in res.detail
    assert mask(tree, 423) == "00000004" and mask(tree, 421) == "00000008"


@pytest.fixture
def fake_systemctl(tmp_path, monkeypatch):
    """A stand-in ``systemctl`` first on PATH that logs its argv (tests never stop host services)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "systemctl.log"
    script = bindir / "systemctl"
    script.write_text(
        "#!/usr/bin/env python3\nimport os, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"rc = {str(tmp_path / 'rc')!r}\n"
        "sys.exit(int(open(rc).read()) if os.path.exists(rc) else 0)\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return log


def test_irqbalance_stop_runs_systemctl_when_configured(tree, fake_systemctl):
    (tree[0] / "77").mkdir()
    (tree[0] / "77" / "comm").write_text("irqbalance\n")
    res = bind_irqs(plan(), host(), cfg(tree, irqbalance="stop"))
    assert fake_systemctl.read_text() == "stop irqbalance\n"
    assert res.outcome is Outcome.APPLIED and res.reason is None
    assert res.data["irqbalance"] == "stopped"


def test_irqbalance_stop_failure_is_reported(tree, fake_systemctl):
    (fake_systemctl.parent / "rc").write_text("5")
    (tree[0] / "77").mkdir()
    (tree[0] / "77" / "comm").write_text("irqbalance\n")
    res = bind_irqs(plan(), host(), cfg(tree, irqbalance="stop"))
    assert res.reason is Reason.IRQBALANCE_ACTIVE and "exited 5" in res.detail


def test_irqbalance_warn_never_runs_systemctl(tree, fake_systemctl):
    (tree[0] / "77").mkdir()
    (tree[0] / "77" / "comm").write_text("irqbalance\n")
    bind_irqs(plan(), host(), cfg(tree))
    assert not fake_systemctl.exists()


# ---------------------------------------------------------------- this machine's /proc/irq


def _real_irqs() -> list[int]:
    try:
        return sorted(int(n) for n in os.listdir("/proc/irq") if n.isdigit())
    except OSError:
        return []


@pytest.mark.skipif(not os.access("/proc/irq", os.W_OK), reason="/proc/irq is not writable here")
def test_real_irq_write_back_same_value():
    with irq_masks_lock():
        _write_back_same_value()


def _write_back_same_value():
    for irq in _real_irqs():
        original = read_irq_mask(irq)
        if original is None:
            continue
        try:
            res = set_irq_affinity(irq, parse_mask(original))
        finally:
            put_back_irq_masks({irq: original})  # leave the host as found, whatever the write did
        if res.status == "ok":
            assert res.previous == original and parse_mask(res.now) == parse_mask(original)
            return
    pytest.skip("no IRQ on this machine accepts a write of its own mask")


@pytest.mark.skipif(not os.access("/proc/irq", os.W_OK), reason="/proc/irq is not writable here")
def test_real_unchangeable_irq_is_reported_as_such():
    for irq in _real_irqs():
        original = read_irq_mask(irq)
        if original is None:
            continue
        res = set_irq_affinity(irq, parse_mask(original))  # same value: harmless if accepted
        if res.status == "unchangeable":
            assert res.error and read_irq_mask(irq) == original
            return
    pytest.skip("no IRQ on this machine rejects writes with EPERM/EIO (no managed IRQ)")
