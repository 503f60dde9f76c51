"""Builders the tests share: an in-process daemon and its config, a fixture /proc tree, a
held binding with its IRQ step.

An in-process ``Daemon`` runs the daemon's own code on this machine's real workers
(tests/workers.py) without a socket: tests that reach its request entry points or its
reconcile loop pass by pass build one here, so that a change to how a daemon is made
is made once. Its state goes under ``tmp_path/state``; ``fixture_daemon`` gives it the
fixture npu-smi (fixtures/bin, the fake one-NPU host) and the shared small pool, as the
real daemon of tests/daemon_harness.py has.

A fixture ``/proc`` (``proc_tree``) stands where the machine lacks what a test needs:
IRQ masks of NPUs it does not have, workers that exist only as a ``stat`` line. The
daemon reads it through ``proc_root`` exactly as it reads ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.daemon.watch.reconcile import Reconciler
from ascendbind.settings import load_config
from ascendbind.values.config import Config
from ascendbind.values.decisions import IrqBinding
from ascendbind.values.frozen import frozen_map
from ascendbind.values.model import Binding, DeviceType, Mode, NpuPlan, Plan, StepResult
from ascendbind.values.reasons import Outcome, Step
from tests.daemon_harness import FIXTURE_BIN

FIXTURE_NPU_SMI = str(FIXTURE_BIN / "npu-smi")
# the start time (clock ticks after boot) of every worker in a fixture /proc tree
START = 5000


# ---------------------------------------------------------------- configs and daemons


def daemon_config(tmp_path: Path, **settings) -> Config:
    """The defaults, with the state under ``tmp_path/state`` and ``settings`` on top."""
    return Config(**{"state_dir": str(tmp_path / "state"), **settings})


def fixture_config(tmp_path: Path, **settings) -> Config:
    """A config for the fixture one-NPU host: its npu-smi, the shared small pool, no memory
    checks of its own (a test moves memory when it means to); ``settings`` on top."""
    return daemon_config(tmp_path, **{"small_pool": "share", "memory_check_seconds": 0,
                                      "npu_smi": FIXTURE_NPU_SMI, **settings})


def fixture_daemon(tmp_path: Path, *, daemon_kw: dict | None = None, **settings) -> Daemon:
    """An in-process daemon on ``fixture_config``; ``daemon_kw`` goes to ``Daemon`` itself
    (a discovery source, a hook among the writes)."""
    return Daemon(fixture_config(tmp_path, **settings), **(daemon_kw or {}))


def proc_config(tmp_path: Path, proc: Path | str) -> Config:
    """The shipped configuration (as ``load_config`` makes it with no file and no
    environment) reading ``proc`` as its /proc, with the state under ``tmp_path/state``."""
    return load_config(None, env={}).replace(proc_root=str(proc), state_dir=str(tmp_path / "state"))


def proc_daemon(tmp_path: Path, proc: Path | str) -> Daemon:
    """An in-process daemon whose /proc is the fixture tree ``proc`` (see ``proc_tree``)."""
    return Daemon(proc_config(tmp_path, proc))


@contextlib.contextmanager
def daemon_loops(tmp_path: Path) -> Iterator:
    """``make(**settings) -> (daemon, reconciler)``: real daemons and their reconcile loops,
    driven pass by pass by the test; every loop made is closed when the block ends."""
    made: list[Reconciler] = []

    def make(**settings) -> tuple[Daemon, Reconciler]:
        d = Daemon(daemon_config(tmp_path, **settings))
        made.append(Reconciler(d))
        return d, made[-1]

    try:
        yield make
    finally:
        for rec in made:
            rec.close()


# ---------------------------------------------------------------- kernel files and a fixture /proc


def write_once(path, text: str) -> None:
    """``text`` written to ``path`` in one write(2), no truncation and no buffering: a
    cgroup or IRQ file takes each write as one value and refuses a partial one."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)



def proc_tree(tmp_path: Path, irqs: dict[int, str], live_pids=()) -> Path:
    """``tmp_path/proc`` holding ``irq/<n>/smp_affinity`` for each IRQ (its mask text), a
    ``<pid>/stat`` started at ``START`` for each live pid, and a boot id."""
    proc = tmp_path / "proc"
    for irq, mask in irqs.items():
        (proc / "irq" / str(irq)).mkdir(parents=True)
        (proc / "irq" / str(irq) / "smp_affinity").write_text(mask + "\n")
    for pid in live_pids:
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (worker) S " + " ".join(["0"] * 18) + f" {START} 0 0\n")
    (proc / "sys" / "kernel" / "random").mkdir(parents=True)
    (proc / "sys" / "kernel" / "random" / "boot_id").write_text("test-boot\n")
    return proc


# ---------------------------------------------------------------- plans and bindings


def irq_binding(pid: int, npu: int, sq: int, cq: int, cpus=(2, 3), saved=("0000ffff", "0000ffff")) -> Binding:
    """A binding of worker ``pid`` (started at ``START``) to ``npu`` whose IRQ step pinned
    its SQ IRQ to ``cpus[0]`` and its CQ IRQ to ``cpus[1]``, the masks before being ``saved``;
    the NPU's pool is the five CPUs from ``cpus[0]``."""
    pool = tuple(range(cpus[0], cpus[0] + 5))
    plan = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, pool,
                (NpuPlan(npu, pool, tuple(cpus), pool[2:3], pool[3:4], pool[4:5], (0,)),))
    writes = [{"irq": sq, "cpus": [cpus[0]], "status": "ok"}, {"irq": cq, "cpus": [cpus[1]], "status": "ok"}]
    irq_step = StepResult(Step.IRQ, Outcome.APPLIED, None, "bound",
                          frozen_map({"npus": [{"npu": npu, "writes": writes}], "previous": {}}))
    irqs = (IrqBinding(npu, sq, frozenset({cpus[0]}), saved[0], "ok"),
            IrqBinding(npu, cq, frozenset({cpus[1]}), saved[1], "ok"))
    return Binding(pid, START, (npu,), plan, frozenset(range(16)),
                   frozen_map({sq: saved[0], cq: saved[1]}), (irq_step,), irqs=irqs)
