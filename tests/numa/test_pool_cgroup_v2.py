"""A worker's own CPUs on a real cgroup v2 hierarchy, and its memory placed by ``ascendbind run``
(the 2node guest: CPUs 0-3 on node 0, 4-7 on node 1; the guest mounts cgroup2 at /sys/fs/cgroup).

* A worker in ``/kubepods/pod<uid>/<id>`` (cpuset 4-7; the kubelet's tree at the top of the
  hierarchy, where only root makes cgroups) is read by discovery from ``cpuset.cpus.effective``.
* The same shape as a container: the worker in a cgroup namespace and a mount namespace of
  its own, with cgroup2 mounted at its ``/sys/fs/cgroup`` as a runtime does; the reader in a
  sibling cgroup with a cgroup namespace of its own too, as a DaemonSet's container is. The
  reader sees the worker's cgroup as ``/../kubepods/...`` and reads its CPUs through the
  worker's own mount; kubelet's checkpoint (in a temporary ``kubelet_root``) then proves
  them the worker's own.
* ``ascendbind run --npu 5`` (NPU 5's pool is on node 1) starts a memory worker that, once
  the bind's own memory move has ended, maps and touches 512 MiB: at least 99 % of it is on
  node 1 and its mapping carries the kernel's ``prefer:1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys

import pytest

from tests.daemon_harness import ROOT, running_daemon, wait_for
from tests.memworker_client import MEMWORKER
from tests.numa.conftest import recorded_npu_smi

CG = "/sys/fs/cgroup"
KUBEPODS = os.path.join(CG, "kubepods")
READER = os.path.join(CG, "ascendbind-v2-reader")
UID = "5e6f7a8b-9c0d-4e1f-a2b3-c4d5e6f7a8b9"
SLOW = 600.0

# writes its own pid into the cgroup named first, then execs the rest: the child starts there
_PLACE = ("import os, sys\n"
          "open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write(str(os.getpid()))\n"
          "os.execvp(sys.argv[2], sys.argv[2:])\n")
_WAIT = "import sys; print('ready', flush=True); sys.stdin.readline()"
# a container's start: cgroup2 mounted in its own mount namespace, rooted at its cgroup namespace
_CONTAINER = ("import ctypes, sys\n"
              "libc = ctypes.CDLL(None, use_errno=True)\n"
              # the inherited mount goes first: the kernel refuses one superblock twice on one mount point
              "assert libc.umount2(b'/sys/fs/cgroup', 2) == 0, ctypes.get_errno()\n"
              "assert libc.mount(b'cgroup2', b'/sys/fs/cgroup', b'cgroup2', 0, None) == 0, ctypes.get_errno()\n"
              + _WAIT)
_OBSERVE = """
import ctypes, json, sys
assert ctypes.CDLL(None, use_errno=True).unshare(0x02000000) == 0, "unshare(CLONE_NEWCGROUP)"
from ascendbind.values.config import Config
from ascendbind.discovery import LiveHost
from ascendbind.discovery.gather.worker import discover_worker
pid, kubelet = int(sys.argv[1]), sys.argv[2]
w = discover_worker(LiveHost(kubelet_root=kubelet), pid, Config(), want_devices=False)
print(json.dumps({"seen_as": open(f"/proc/{pid}/cgroup").read().strip(), "cpus": sorted(w.allowed_cpus),
                  "source": w.allowed_source, "own": w.pool_evidence.own, "why": w.pool_evidence.detail}))
"""


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


@pytest.fixture
def tree():
    """/kubepods/pod<uid>/{<c1>, <c2>} and /ascendbind-v2-reader: the containers on 4-7."""
    c1, c2 = "c1" * 32, "c2" * 32
    pod = os.path.join(KUBEPODS, f"pod{UID}")
    made = []
    try:
        _write(os.path.join(CG, "cgroup.subtree_control"), "+cpuset")
        for path in (KUBEPODS, pod, os.path.join(pod, c1), os.path.join(pod, c2), READER):
            os.mkdir(path)
            made.append(path)
        for path in (KUBEPODS, pod):
            _write(os.path.join(path, "cgroup.subtree_control"), "+cpuset")
        for c in (c1, c2):
            _write(os.path.join(pod, c, "cpuset.cpus"), "4-7")
        yield {"c1": os.path.join(pod, c1), "c2": os.path.join(pod, c2), "reader": READER,
               "ids": (c1, c2)}
    finally:
        for path in reversed(made):
            os.rmdir(path)


@contextlib.contextmanager
def started(argv: list[str]):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()
        p.wait()


def test_cgroup_v2_cpuset_is_read_also_from_another_cgroup_namespace(tree, tmp_path):
    from ascendbind.values.config import Config
    from ascendbind.discovery import LiveHost
    from ascendbind.discovery.gather.worker import discover_worker

    kubelet = tmp_path / "kubelet"
    kubelet.mkdir()
    (kubelet / "cpu_manager_state").write_text(json.dumps(
        {"policyName": "static", "defaultCpuSet": "0-3", "entries": {UID: {"vllm": "4-7"}}, "checksum": 1}))
    py = [sys.executable, "-S"]
    with started([*py, "-c", _PLACE, tree["c1"], *py, "-c", _WAIT]) as plain, \
            started([*py, "-c", _PLACE, tree["c2"], "unshare", "--cgroup", "--mount", "--propagation", "private",
                     "--", *py, "-c", _CONTAINER]) as boxed:
        w = discover_worker(LiveHost(kubelet_root=str(kubelet)), plain.pid, Config(), want_devices=False)
        assert (w.allowed_source, sorted(w.allowed_cpus)) == ("cgroup", [4, 5, 6, 7])
        assert w.cpuset_path == f"/kubepods/pod{UID}/{tree['ids'][0]}" and w.pool_evidence.own
        r = subprocess.run([sys.executable, "-c", _PLACE, tree["reader"], sys.executable, "-c", _OBSERVE,
                            str(boxed.pid), str(kubelet)], capture_output=True, text=True, cwd=ROOT, timeout=SLOW)
        assert r.returncode == 0, r.stderr
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["seen_as"] == f"0::/../kubepods/pod{UID}/{tree['ids'][1]}"
        assert (seen["source"], seen["cpus"]) == ("cgroup", [4, 5, 6, 7]) and seen["own"], seen


@pytest.fixture
def daemon(tmp_path):
    env = {"ASCENDBIND_NPU_SMI": recorded_npu_smi(str(tmp_path / "npu-smi"), 8, "0-7"),
           "ASCENDBIND_MEMORY_CHECK_SECONDS": "0", "ASCENDBIND_COMMAND_TIMEOUT_SECONDS": "60"}
    (tmp_path / "daemon").mkdir()
    with running_daemon(str(tmp_path / "daemon"), ready_timeout=SLOW, **env) as d:
        d.wait_discovered(SLOW)
        yield d


def _kib_by_node(line: str) -> dict[int, int]:
    kib = next(int(w.partition("=")[2]) for w in line.split() if w.startswith("kernelpagesize_kB="))
    return {int(k[1:]): int(v) * kib for k, _, v in (w.partition("=") for w in line.split())
            if k[:1] == "N" and k[1:].isdigit() and v.isdigit()}


def _line(p: subprocess.Popen, daemon, what: str) -> str:
    """The command's next line, within SLOW seconds (a hang is a failure with the daemon's log)."""
    if not select.select([p.stdout], [], [], SLOW)[0]:
        raise AssertionError(f"no {what} line from the command in {SLOW:g} s; daemon log: {daemon.log()[-2000:]}")
    return p.stdout.readline()


def test_run_places_a_commands_memory_on_its_pools_node_from_the_first_page(daemon):
    argv = [sys.executable, "-m", "ascendbind.cli", "run", "--npu", "5", "--", sys.executable, "-S", MEMWORKER,
            "--private-mib", "0"]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=daemon.env, cwd=ROOT)
    try:
        assert _line(p, daemon, "ready").startswith("ready "), daemon.log()[-2000:]
        (w,) = daemon.client.workers()["workers"]
        pool_node = w["plan"]["npus"]["5"]["numa_nodes"]
        assert pool_node == [1]
        # the bind's own move of the child's pages has ended: nothing moves the 512 MiB but the policy
        assert wait_for(lambda: (daemon.client.workers()["workers"][0].get("memory") or {}).get("state")
                        in ("done", "skipped", "failed"), SLOW)
        p.stdin.write("alloc 512\n")
        p.stdin.flush()
        region = json.loads(_line(p, daemon, "alloc").partition(" ")[2])
        with open(f"/proc/{w['pid']}/numa_maps") as fh:
            line = next(ln for ln in fh if int(ln.split()[0], 16) == region["start"])
        kib = _kib_by_node(line)
        assert line.split()[1] == "prefer:1", line
        assert sum(kib.values()) >= 512 * 1024 * 0.99 and kib.get(1, 0) / sum(kib.values()) >= 0.99, line
    finally:
        p.kill()
        p.wait()
