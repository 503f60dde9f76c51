"""Small helpers the benches share: the machine's description and --json output."""

from __future__ import annotations

import json
import os
import platform
import sys
import time


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
