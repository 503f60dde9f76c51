"""Golden plan cases: fixtures/hosts/<host>/expected/<case>.json.

Each file is {"argv": [...plan flags...], "exit": N, "plan": <plan JSON>}; the
test runs ``ascendbind plan --snapshot <host> --format json <argv>`` in-process
and compares. ``python -m tests.golden --write`` regenerates them (review the
diff by hand: a golden is a claim about the placement rules, not a recording).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "fixtures", "hosts")

# host -> case name -> plan flags
CASES: dict[str, dict[str, list[str]]] = {
    "a2-8x910b3": {
        "npu0": ["--npu", "0"],
        "npu3": ["--npu", "3"],
        "npu3-single-numa-node": ["--npu", "3", "--topology-policy", "single-numa-node"],
        "npu3-numa-extension-none": ["--npu", "3", "--numa-extension", "none"],
        "all-npus": [*sum((["--npu", str(i)] for i in range(8)), [])],
        "pid-4242": ["--pid", "4242"],
        "irq-binding-off": ["--npu", "5", "--irq-binding", "false"],
    },
    "a2-container": {
        "npu0": ["--npu", "0"],
        "npu2": ["--npu", "2"],
    },
    "a3-16die": {
        "npu0": ["--npu", "0"],
        "npu5": ["--npu", "5"],
        "npu15": ["--npu", "15"],
        "cpuset-3-200-npu5": ["--pid", "1001", "--npu", "5"],
        "cpuset-3-200-npu5-single-numa-node": ["--pid", "1001", "--npu", "5", "--topology-policy", "single-numa-node"],
        "cpuset-4-131-npu9-single-numa-node": ["--pid", "1003", "--npu", "9", "--topology-policy", "single-numa-node"],
        "npu-out-of-range": ["--npu", "16"],
    },
    "310p-4card": {
        "npu0": ["--npu", "0"],
        "npu5": ["--npu", "5"],
    },
    "950-4numa": {
        "npu0": ["--npu", "0"],
        "npu3": ["--npu", "3"],
        "npu6": ["--npu", "6"],
    },
    "malformed-a2": {
        "npu0": ["--npu", "0"],
    },
    # the deployments of docs/integrations.md, one worker pid each (fixtures/hosts/README.md)
    "a2-pods": {
        "bare-listed": ["--pid", "7101"],
        "bare-listed-device-index-2": ["--pid", "7101", "--device-index", "2"],
        "bare-listed-device-index-3": ["--pid", "7101", "--device-index", "3"],
        "bare-rt-visible": ["--pid", "7102"],
        "bare-rt-visible-device-index-1": ["--pid", "7102", "--device-index", "1"],
        "docker-visible-devices-listed": ["--pid", "7103"],
        "docker-visible-devices-npu0": ["--pid", "7103", "--npu", "0"],
        "docker-device-flag": ["--pid", "7104"],
        "device-plugin": ["--pid", "7105"],
        "device-plugin-device-index-0": ["--pid", "7105", "--device-index", "0"],
        "device-plugin-npu0": ["--pid", "7105", "--npu", "0"],
        "device-plugin-listed-elsewhere": ["--pid", "7106"],
        "hami-vnpu-device-index-0": ["--pid", "7107", "--device-index", "0"],
        "dev-unreadable-visible-devices": ["--pid", "7108"],
        "container-without-npus": ["--pid", "7109"],
        "driver-map": ["--pid", "7110"],
    },
    "950-pods": {
        "device-plugin-device-index-0": ["--pid", "9501", "--device-index", "0"],
        "bare-device-index-5": ["--pid", "9502", "--device-index", "5"],
        "two-devices-device-index-0": ["--pid", "9503", "--device-index", "0"],
        "two-devices-device-index-1": ["--pid", "9503", "--device-index", "1"],
        "driver-map": ["--pid", "9504"],
    },
    # workers that bring their own CPUs: kubelet's static CPU manager (fixtures/hosts/README.md)
    "a3-k8s": {
        "guaranteed-pod-npu5": ["--pid", "2105", "--npu", "5"],
        "guaranteed-pod-npu5-slice": ["--pid", "2105", "--npu", "5", "--pool-source", "slice"],
        "guaranteed-pod-npu5-single-numa-node": ["--pid", "2105", "--npu", "5", "--topology-policy",
                                                 "single-numa-node"],
        "stale-entry-npu6": ["--pid", "2106", "--npu", "6"],
        "burstable-npu7": ["--pid", "2107", "--npu", "7"],
        "docker-cpuset-npu10": ["--pid", "2108", "--npu", "10"],
        "docker-cpuset-npu10-cpuset": ["--pid", "2108", "--npu", "10", "--pool-source", "cpuset"],
    },
    "a2-k8s": {
        "guaranteed-pod": ["--pid", "3101"],
        "guaranteed-pod-slice": ["--pid", "3101", "--pool-source", "slice"],
    },
}


def run_plan(host: str, argv: list[str]) -> tuple[int, dict | None, str]:
    from ascendbind.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", "--snapshot", os.path.join(HOSTS, host), "--format", "json", *argv])
    text = out.getvalue()
    plan = json.loads(text) if text.strip().startswith("{") else None
    return code, plan, err.getvalue()


def golden_path(host: str, case: str) -> str:
    return os.path.join(HOSTS, host, "expected", f"{case}.json")


def all_cases():
    for host, cases in CASES.items():
        for case, argv in cases.items():
            yield host, case, argv


def write_all() -> None:
    # the config file of the machine running this must not leak into goldens
    os.environ.pop("ASCENDBIND_CONFIG", None)
    for host, case, argv in all_cases():
        if not os.path.isdir(os.path.join(HOSTS, host)):
            print(f"skip {host}: no fixture")
            continue
        code, plan, err = run_plan(host, argv)
        os.makedirs(os.path.dirname(golden_path(host, case)), exist_ok=True)
        with open(golden_path(host, case), "w") as fh:
            json.dump({"argv": argv, "exit": code, "plan": plan}, fh, indent=1)
            fh.write("\n")
        print(f"{host}/{case}: exit {code} {err.strip()[:100]}")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write_all()
