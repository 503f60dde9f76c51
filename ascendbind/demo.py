"""``python -m ascendbind.demo`` (``make run``): watch ascendbind bind a real process.

What it does, on any Linux box with one CPU or more:

1. puts the bundled fixture ``npu-smi`` (``fixtures/bin``) first on PATH: it
   describes this machine as an Atlas A2 host with one "Ascend 910B3" NPU whose
   CPU affinity is every online CPU here;
2. starts a demo worker: a Python child with threads named like an Ascend
   inference worker's (``worker_*``, ``acl_thread``, ``release_thread``);
3. runs the path of ``ascendbind apply --pid <demo> --npu 0`` with
   ``small_pool = "share"`` (so a 2-CPU box still gets every role): live
   discovery -> plan -> apply, printing each thread's CPUs before and after;
4. releases the binding (every thread back to its allowed CPUs) and reaps the child.

The IRQ step is skipped with a reason (the fake NPU's PCI address does not
exist here); the memory step is skipped on a single-NUMA-node machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .applier import apply_plan, release_binding
from .applier.affinity import role_of, thread_masks
from .config import load_config
from .cpulist import format_cpulist
from .discovery import LiveHost, discover_host, discover_worker
from .errors import AscendbindError
from .model import DeviceType
from .planner import make_plan, select_targets
from .render import plan_table, steps_table

FIXTURE_BIN = Path(__file__).resolve().parent.parent / "fixtures" / "bin"
THREAD_NAMES = ("worker_0", "worker_1", "worker_2", "acl_thread", "release_thread")

_CHILD = r"""
import ctypes, sys, threading
libc = ctypes.CDLL(None)
def run(name, ready):
    libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    ready.set()
    threading.Event().wait()
for name in sys.argv[1:]:
    ready = threading.Event()
    threading.Thread(target=run, args=(name, ready), daemon=True).start()
    ready.wait()
print("ready", flush=True)
sys.stdin.read()  # until the demo closes our stdin
"""


def _print_threads(title: str, pid: int) -> None:
    print(title)
    masks = thread_masks(pid)
    for tid in sorted(masks):
        comm, cpus = masks[tid]
        print(f"  tid {tid:<8} {comm:<16} {role_of(comm):<8} CPUs {format_cpulist(cpus)}")


def main() -> int:
    npu_smi = FIXTURE_BIN / "npu-smi"
    if not npu_smi.exists():
        print(f"demo: the fixture npu-smi is missing ({npu_smi}); run from a source checkout", file=sys.stderr)
        return 1
    os.environ["PATH"] = f"{FIXTURE_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.pop("ASCENDBIND_FIXTURE_HOST", None)  # synthesise this host, replay nothing

    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *THREAD_NAMES], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            print("demo: the demo worker did not start", file=sys.stderr)
            return 1
        pid = child.pid
        os.environ["ASCENDBIND_FAKE_NPU_PIDS"] = str(pid)
        print(f"demo worker pid {pid}; fake npu-smi: {npu_smi}")
        print(f"same path as: ascendbind apply --pid {pid} --npu 0   (ASCENDBIND_SMALL_POOL=share)\n")
        _print_threads("before:", pid)

        config = load_config(overrides={"small_pool": "share"})
        source = LiveHost.from_config(config)
        host = discover_host(source, config)
        worker = discover_worker(source, pid, config, want_uvb=host.device_type is DeviceType.A950)
        plan = make_plan(host, worker, select_targets(host, worker, [0]), config)
        print("\nplan:")
        print(plan_table(plan))
        if plan.errors:
            print("demo: no plan for this host:", "; ".join(e.reason for e in plan.errors), file=sys.stderr)
            return 3
        binding = apply_plan(plan, worker, host, config)
        print("\nsteps:")
        print(steps_table(binding.steps))
        print()
        _print_threads("after:", pid)

        released = release_binding(binding, config)
        print("\nrelease:")
        print(steps_table(released))
        _print_threads("\nafter release:", pid)
        return 8 if binding.failed else 0
    except AscendbindError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return exc.exit_status
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stdout:
            child.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
