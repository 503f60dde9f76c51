"""`ascendbind plan` as an operator runs it: real subprocesses, fixture snapshots."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "fixtures", "hosts")


def ascendbind(*argv, env=None, path=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDBIND_")}
    if path is not None:
        e["PATH"] = path
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ascendbind", *argv], capture_output=True, text=True, env=e,
                          cwd=ROOT, timeout=60)


def test_seed_a3_row_for_npu5_in_the_table():
    r = ascendbind("plan", "--snapshot", os.path.join(HOSTS, "a3-16die"), "--npu", "5")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] == ["5"]]
    # NPU  POOL     IRQ      MAIN     ACL  RELEASE  NUMA
    assert rows == [["5", "200-239", "200-201", "202-237", "238", "239", "2"]]
    assert "global_slice" in r.stdout


def test_seed_a3_every_worker_gets_its_40_cpu_slice():
    argv = sum((["--npu", str(i)] for i in range(16)), [])
    r = ascendbind("plan", "--snapshot", os.path.join(HOSTS, "a3-16die"), "--format", "json", *argv)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    for i in range(16):
        p = plan["npus"][str(i)]
        assert p["pool"] == list(range(40 * i, 40 * i + 40))
        assert p["irq"] == [40 * i, 40 * i + 1]
        assert p["main"] == list(range(40 * i + 2, 40 * i + 38))
        assert p["acl"] == [40 * i + 38] and p["release"] == [40 * i + 39]


@pytest.mark.parametrize("npu,pool", [(0, list(range(144, 168))), (2, list(range(168, 192)))])
def test_seed_a2_hidden_same_affinity_npus_split_the_pool(npu, pool):
    r = ascendbind("plan", "--snapshot", os.path.join(HOSTS, "a2-container"), "--npu", str(npu), "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["mode"] == "topo_affinity"
    assert plan["allowed_cpus"] == list(range(144, 192))
    assert list(plan["npus"]) == [str(npu)]
    assert plan["npus"][str(npu)]["pool"] == pool


def test_live_plan_without_npu_smi_says_use_snapshot(tmp_path):
    # a PATH holding only lscpu: no npu-smi on this "host"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("lscpu", "ps"):
        src = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        if src:
            os.symlink(src, bindir / tool)
    r = ascendbind("plan", path=str(bindir))
    assert r.returncode == 5, r.stdout + r.stderr
    assert "--snapshot" in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_impossible_plan_exits_3_with_the_reason():
    r = ascendbind("plan", "--snapshot", os.path.join(HOSTS, "a3-16die"), "--npu", "16")
    assert r.returncode == 3
    assert "16" in r.stderr and "Traceback" not in r.stderr


def test_bad_flag_is_usage_error():
    r = ascendbind("plan", "--npu", "x")
    assert r.returncode == 2


def test_missing_snapshot_dir_is_usage_error(tmp_path):
    r = ascendbind("plan", "--snapshot", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert "does not exist" in r.stderr
