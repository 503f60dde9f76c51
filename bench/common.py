"""Small helpers the benches share: the machine's description, --json output and a run in
the two-node guest."""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                # x86 says "model name"; arm64 kernels print no model name, only the part number
                if key.strip() in ("model name", "Model", "CPU part"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What a reader needs to weigh a figure: CPUs, model, kernel, load when measured."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "online_cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in load],
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def write_json(path: str | None, payload: dict) -> None:
    """Write the bench's machine-readable result (``--json PATH``; ``-`` is stdout)."""
    if not path:
        return
    payload = {"machine": machine(), **payload}
    if path == "-":
        json.dump(payload, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)


def results_from_guest(argv: Callable[[str], list[str]], result: str, *, timeout: float = 3600,
                       on_line: Callable | None = None) -> dict | None:
    """Boot the two-node guest (tests/numa_guest.py), run ``argv(out)`` there (``out``: the
    directory the guest may write) and return the JSON it left in ``out/result``; None, with
    why on stderr, when the guest cannot boot or wrote none. ``on_line``: run_in_guest's."""
    from tests.numa_guest import TOPOLOGIES, run_in_guest, why_not

    why = why_not()
    if why:
        print(why, file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory(prefix="bench-guest-") as out:
        os.chmod(out, 0o755)
        proc = run_in_guest(TOPOLOGIES["2node"], argv(out), out_dir=out, timeout=timeout, on_line=on_line)
        path = os.path.join(out, result)
        if not os.path.exists(path):
            sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-3000:])
            return None
        with open(path) as fh:
            return json.load(fh)


def seconds_until_mask(tid: int, cpus: frozenset[int], timeout: float, poll: float) -> float | None:
    """Seconds until thread ``tid``'s mask reads ``cpus`` (polled every ``poll`` s), None
    past ``timeout`` or once the thread is gone: how long the daemon took to pin it."""
    t0 = time.monotonic()
    while True:
        try:
            if frozenset(os.sched_getaffinity(tid)) == cpus:
                return time.monotonic() - t0
        except OSError:
            return None
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(poll)
