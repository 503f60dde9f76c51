"""`ascendbind apply` binding real workers on this host; only npu-smi is faked
(fixtures/bin/npu-smi describes this machine's CPUs as one 910B3 NPU)."""

import json
import os
import subprocess
import sys

from tests.workers import start_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_BIN = os.path.join(ROOT, "fixtures", "bin")


def ascendbind(*argv, env=None, prefix=()):
    e = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDBIND_")}
    e["PATH"] = FAKE_BIN + os.pathsep + e.get("PATH", "")
    e.update(env or {})
    return subprocess.run([*prefix, sys.executable, "-m", "ascendbind", *argv], capture_output=True, text=True,
                          env=e, cwd=ROOT, timeout=60)


def by_role(worker):
    """comm -> Cpus_allowed_list read back from /proc/<pid>/task/*/status."""
    masks = worker.cpus_allowed()
    return {worker.threads()[tid]: cpus for tid, cpus in masks.items()}


def test_apply_binds_every_role_for_real_with_shared_small_pool():
    with start_worker(plain=3, acl=1, release=1) as w:
        r = ascendbind("apply", "--pid", str(w.pid), "--npu", "0", "--format", "json",
                       env={"ASCENDBIND_SMALL_POOL": "share"})
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        npu = out["plan"]["npus"]["0"]
        pool = sorted(os.sched_getaffinity(0))
        assert npu["pool"] == pool
        if pool == [0, 1]:  # a 2-CPU host (CI): the shared-roles split of a 2-CPU pool
            assert (npu["main"], npu["acl"], npu["release"]) == ([0], [1], [1])
        after = by_role(w)
        for comm, cpus in after.items():
            if comm.startswith("acl_thread"):
                assert cpus == frozenset(npu["acl"]), comm
            elif comm.startswith("release_thread"):
                assert cpus == frozenset(npu["release"]), comm
            else:
                assert cpus == frozenset(npu["main"]), comm
        steps = {s["step"]: s for s in out["steps"]}
        assert steps["affinity"]["outcome"] == "applied"
        # the fake NPU's PCI device does not exist here: skipped, with a reason, never silently
        assert steps["irq"]["outcome"] == "skipped" and steps["irq"]["reason"]
        assert steps["memory"]["outcome"] in ("skipped", "applied")


def test_apply_target_from_the_npu_smi_process_table():
    with start_worker(plain=1) as w:
        r = ascendbind("apply", "--pid", str(w.pid), "--format", "json",
                       env={"ASCENDBIND_SMALL_POOL": "share", "ASCENDBIND_FAKE_NPU_PIDS": str(w.pid)})
        assert r.returncode == 0, r.stderr
        assert list(json.loads(r.stdout)["plan"]["npus"]) == ["0"]


def test_apply_small_pool_from_a_config_file(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('small_pool = "share"\n')
    with start_worker(plain=1) as w:
        r = ascendbind("apply", "--config", str(cfg), "--pid", str(w.pid), "--npu", "0")
        assert r.returncode == 0, r.stderr
        assert "affinity  applied" in r.stdout


def test_apply_impossible_plan_exits_3_and_changes_nothing():
    # The pool needs 5 CPUs; a worker allowed at most 2 (its Cpus_allowed_list as
    # first seen) cannot get one, on this host or a bigger one.
    narrow = set(sorted(os.sched_getaffinity(0))[:2])
    with start_worker(plain=1) as w:
        for tid in w.threads():
            os.sched_setaffinity(tid, narrow)
        before = w.cpus_allowed()
        assert set(before.values()) == {frozenset(narrow)}
        r = ascendbind("apply", "--pid", str(w.pid), "--npu", "0", env={"ASCENDBIND_SMALL_POOL": "fail"})
        assert r.returncode == 3, r.stdout + r.stderr
        assert "small_pool" in r.stderr and "Traceback" not in r.stderr
        assert w.cpus_allowed() == before


def test_apply_unprivileged_caller_exits_7_and_changes_nothing(nobody_prefix):
    with start_worker(plain=1) as w:
        before = w.cpus_allowed()
        r = ascendbind("apply", "--pid", str(w.pid), "--npu", "0", env={"ASCENDBIND_SMALL_POOL": "share"},
                       prefix=nobody_prefix)
        assert r.returncode == 7, r.stdout + r.stderr
        assert "CAP_SYS_NICE" in r.stderr
        assert w.cpus_allowed() == before


def test_apply_dead_pid_exits_6_with_one_line():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    r = ascendbind("apply", "--pid", str(proc.pid), "--npu", "0", env={"ASCENDBIND_SMALL_POOL": "share"})
    assert r.returncode == 6
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_apply_without_npu_and_without_process_row_says_what_it_tried():
    with start_worker(plain=1) as w:
        r = ascendbind("apply", "--pid", str(w.pid), env={"ASCENDBIND_SMALL_POOL": "share"})
        assert r.returncode == 3, r.stdout + r.stderr
        assert "ASCEND_RT_VISIBLE_DEVICES" in r.stderr


def _cpus_of_every_thread(pid):
    from tests.workers import cpus_allowed_of

    return {int(t): cpus_allowed_of(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_apply_to_init_or_a_kernel_thread_exits_7_and_changes_nothing():
    for pid, npu in ((1, ["--npu", "0"]), (1, []), (2, ["--npu", "0"])):
        before = _cpus_of_every_thread(pid)
        r = ascendbind("apply", "--pid", str(pid), *npu, env={"ASCENDBIND_SMALL_POOL": "share"})
        try:
            assert r.returncode == 7, r.stdout + r.stderr
            assert r.stderr.strip().splitlines() == [
                "ascendbind: pid 1 is init (pid 1) of this pid namespace: ascendbind never binds it" if pid == 1
                else "ascendbind: pid 2 (kthreadd) is a kernel thread: ascendbind never binds it"]
            assert _cpus_of_every_thread(pid) == before
        finally:
            for tid, cpus in before.items():  # leave the host as found, should this ever regress
                if cpus and _cpus_of_every_thread(pid).get(tid) not in (None, cpus):
                    os.sched_setaffinity(tid, cpus)
