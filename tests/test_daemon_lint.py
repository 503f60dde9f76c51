"""Config lint at daemon start-up: a real ``ascendbind serve``
logs each lint sentence once as a warning after the host is discovered, whether
the start-up warm-up or a later request discovered it, and again after SIGHUP.

``single-numa-node`` with the default ``numa_extension = next`` is a lint on any
host the fake npu-smi describes (topo_affinity mode), whatever its NUMA layout.
"""

from __future__ import annotations

import json
import os
import signal

from tests.daemon_harness import FIXTURE_BIN, DaemonProc, base_env, free_port, wait_for

EXTENSION = "numa_extension = next does nothing under topology_policy = single-numa-node"


def _lint_lines(log: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "config lint":
            out.append(rec)
    return out


def _count(log: str, text: str) -> int:
    return sum(text in rec.get("detail", "") for rec in _lint_lines(log))


def _daemon(tmp_path, **extra) -> DaemonProc:
    env = base_env(str(tmp_path / "ascendbind.sock"), str(tmp_path / "state"), free_port(),
                   ASCENDBIND_TOPOLOGY_POLICY="single-numa-node", **extra)
    return DaemonProc(str(tmp_path), env)


def test_lint_is_logged_once_after_discovery_and_again_after_sighup(tmp_path):
    d = _daemon(tmp_path).start()
    try:
        d.wait_discovered()
        assert wait_for(lambda: _count(d.log(), EXTENSION) == 1, 5), d.log()
        lines = _lint_lines(d.log())
        assert all(rec["level"] == "warning" for rec in lines)
        # small_pool = share (the harness's) under a strict policy is the second tension
        assert _count(d.log(), "small_pool = share under topology_policy = single-numa-node") == 1
        first = len(lines)

        d.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "rediscovered" in d.log(), 10), d.log()
        assert wait_for(lambda: _count(d.log(), EXTENSION) == 2, 5), d.log()
        # the same config again: every sentence once more, nothing else
        assert len(_lint_lines(d.log())) == 2 * first
    finally:
        d.stop()


def test_lint_waits_for_the_first_discovery_that_succeeds(tmp_path):
    npu_smi = tmp_path / "bin" / "npu-smi"
    npu_smi.parent.mkdir()
    d = _daemon(tmp_path, ASCENDBIND_NPU_SMI=str(npu_smi)).start()
    try:
        # npu-smi is missing: the warm-up discovery fails and nothing can be linted yet
        assert wait_for(lambda: d.client.health()["discovery"] != "not yet discovered", 10), d.log()
        assert d.client.health()["discovery"] != "ok"
        assert _lint_lines(d.log()) == []

        tmp = f"{npu_smi}.new"
        with open(tmp, "w") as fh:
            fh.write(f'#!/bin/sh\nexec "{FIXTURE_BIN}/npu-smi" "$@"\n')
        os.chmod(tmp, 0o755)
        os.replace(tmp, npu_smi)
        # a request discovers the host (after the cached failure expires); the lint follows it
        assert wait_for(lambda: d.curl("GET", "/v1/plan?npu=0")[0] != 503, 10), d.log()[-2000:]
        assert d.client.health()["discovery"] == "ok"
        assert wait_for(lambda: _count(d.log(), EXTENSION) == 1, 5), d.log()
    finally:
        d.stop()
