"""`ascendbind plan` as an operator runs it: real subprocesses, fixture snapshots."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.workers import start_worker

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


# ---------------------------------------------------------------- no traceback, ever


def one_line_error(r, status: int) -> str:
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ascendbind: "), r.stderr
    return lines[0]


def fixture_copy(tmp_path, name: str = "a2-8x910b3") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(os.path.join(HOSTS, name), dst, ignore=shutil.ignore_patterns("expected"))
    return dst


@pytest.mark.parametrize(
    "content,says",
    [
        (b"", "empty"),
        (b'{"arch": "aarch64", "env": {"ASCEND_RT_VIS', "not valid JSON"),
        (b"[]", "expected a JSON object, got list"),
        (b'{"env": "x"}', "'env' must be an object of strings"),
        (b'{"env": {"ASCEND_RT_VISIBLE_DEVICES": 3}}', "'env' must be an object of strings"),
        (b'{"pid": "12"}', "'pid' must be a positive integer"),
        (b'{"arch": "aarch64", "env": {}, "note": "\xff\xfe"}', "not UTF-8"),
    ],
)
def test_a_malformed_meta_json_exits_5_naming_the_file(tmp_path, content, says):
    snap = fixture_copy(tmp_path)
    meta = os.path.join(snap, "meta.json")
    with open(meta, "wb") as fh:
        fh.write(content)
    line = one_line_error(ascendbind("plan", "--snapshot", snap, "--npu", "0"), 5)
    assert meta in line and says in line


def test_an_empty_directory_is_not_a_snapshot(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_line_error(ascendbind("plan", "--snapshot", str(empty)), 2)
    assert "is not a snapshot" in line and "npu-smi" not in line


def test_a_snapshot_plans_for_the_pid_it_was_recorded_for(tmp_path):
    # the fixture npu-smi describes this machine; the worker is a real process
    snap = str(tmp_path / "snap")
    env = {"PATH": f"{os.path.join(ROOT, 'fixtures', 'bin')}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    with start_worker(plain=1, acl=1, release=1) as w:
        r = ascendbind("snapshot", snap, "--pid", str(w.pid), env=env)
        assert r.returncode == 0, r.stderr
    assert json.load(open(os.path.join(snap, "meta.json")))["pid"] == w.pid
    assert not os.path.exists(os.path.join(snap, "proc", "self"))  # only the worker was recorded
    r = ascendbind("plan", "--snapshot", snap, "--npu", "0", "--small-pool", "share", "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert list(plan["npus"]) == ["0"] and plan["errors"] == []
    # an explicit --pid still wins: that pid was not recorded
    line = one_line_error(ascendbind("plan", "--snapshot", snap, "--npu", "0", "--pid", "1"), 6)
    assert "no process 1" in line


@pytest.mark.parametrize("where", ["under_a_file", "under_proc", "under_sys"])
def test_snapshot_into_an_impossible_place_is_one_line_exit_2(tmp_path, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = {"under_a_file": str(blocker / "snap"), "under_proc": "/proc/ascendbind-snap",
           "under_sys": "/sys/fs/cgroup/ascendbind-snap-test"}[where]
    line = one_line_error(ascendbind("snapshot", out), 2)
    assert out in line
    assert not os.path.exists(out)  # nothing created, not even a cgroup


def test_snapshot_into_an_unwritable_directory_is_one_line_exit_2(tmp_path, nobody_prefix):
    parent = tmp_path / "root-only"
    parent.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDBIND_")}
    r = subprocess.run([*nobody_prefix, sys.executable, "-m", "ascendbind", "snapshot", str(parent / "snap")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    line = one_line_error(r, 2)
    assert "cannot write" in line and str(parent) in line


def test_json_plan_is_printed_compactly_and_reads_back_the_same():
    # the A2 NPU3 plan: 192 allowed CPUs and 24 hints, one number per line was 455 lines (now
    # with the target rule's evidence, seven sources of a line or a few each)
    r = ascendbind("plan", "--snapshot", os.path.join(HOSTS, "a2-8x910b3"), "--npu", "3", "--format", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["allowed_cpus"] == list(range(192)) and plan["npus"]["3"]["pool"] == list(range(120, 144))
    lines = r.stdout.splitlines()
    assert len(lines) < 150, len(lines)
    assert '      "irq": [120, 121],' in lines and '      "acl": [142],' in lines
