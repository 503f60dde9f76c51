"""Tests that need a real kernel with several NUMA nodes. tests/numa_guest.py boots one
(QEMU, this machine's kernel and root) and runs them there; anywhere else they are
not collected (tests/conftest.py), and run by hand outside a guest they fail here
rather than pass on a one-node machine."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from tests.daemon_harness import FIXTURE_BIN

GUEST_ENV = "NUMA_GUEST_TOPOLOGY"


def online_nodes() -> list[int]:
    return sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit())


@pytest.fixture(scope="session", autouse=True)
def numa_guest():
    """The topology the guest was booted with, checked against the kernel's own view."""
    name = os.environ.get(GUEST_ENV)
    assert name, "tests/numa/ runs in the NUMA guest: make test-numa (python -m tests.numa_guest)"
    want = {"2node": 2, "isolation": 2, "4node": 4, "kunpeng920": 4}[name]
    assert len(online_nodes()) == want, f"the {name} guest shows nodes {online_nodes()}"
    return name


# Python starts some 50 times slower in the guest than on the host, and discovery runs
# npu-smi once per table and NPU: the fixture's answers are recorded once per session
# and replayed by a shell script, so a daemon's discovery costs seconds, not minutes
REPLAY = """#!/bin/sh
IFS=_
f="{dir}/cmd/npu-smi_$*.txt"
if [ -f "$f" ]; then exec cat "$f"; fi
IFS=' '
echo "npu-smi (recorded): no recording for npu-smi $*" >&2
exit 1
"""


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """``os.environ`` with ``values`` set, as it was again afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def recorded_npu_smi(directory: str, npus: int, affinity: str) -> str:
    """A replaying npu-smi for ``npus`` fixture NPUs with CPU affinity ``affinity`` (each
    NPU's cpulist, ``;``-separated); returns its path. The fixture's tables are made in
    this process (loaded from fixtures/bin/npu-smi), not by starting it once per table."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("fixture_npu_smi", str(FIXTURE_BIN / "npu-smi"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    fixture = importlib.util.module_from_spec(spec)
    loader.exec_module(fixture)
    env = {"ASCENDBIND_FAKE_NPUS": str(npus), "ASCENDBIND_FAKE_NPU_AFFINITY": affinity,
           "ASCENDBIND_FAKE_NPU_PIDS": "", "ASCENDBIND_FIXTURE_HOST": ""}
    os.makedirs(os.path.join(directory, "cmd"), exist_ok=True)
    tables = [["info"], ["info", "-m"], ["info", "-t", "topo"],
              *(["info", "-t", "board", "-i", str(k)] for k in range(npus))]
    with environ(env):
        for argv in tables:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert fixture.synthesise(argv) == 0, argv
            with open(os.path.join(directory, "cmd", "npu-smi_" + "_".join(argv) + ".txt"), "w") as fh:
                fh.write(out.getvalue())
    path = os.path.join(directory, "npu-smi")
    with open(path, "w") as fh:
        fh.write(REPLAY.format(dir=directory))
    os.chmod(path, 0o755)
    return path


def plan_json(npu_env: dict[str, str], *flags: str) -> dict:
    """``ascendbind plan --npu 0`` as JSON, in this process (its imports are loaded already:
    a new interpreter costs half a minute in a guest)."""
    from ascendbind.cli import main

    out, err = io.StringIO(), io.StringIO()
    with environ({**npu_env, "ASCENDBIND_CONFIG": ""}), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = main(["plan", "--npu", "0", "--small-pool", "share", "--format", "json", *flags])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())
