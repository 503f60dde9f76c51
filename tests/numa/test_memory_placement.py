"""The memory step on a real two-node kernel (the 2node guest: CPUs 0-3 on node 0, 4-7 on node 1).

One ``ascendbind serve`` for the module, with the fixture npu-smi describing eight NPUs
whose pools are one CPU each: NPUs 0-3 on node 0, NPUs 4-7 on node 1. Workers are started under
``numactl --membind=1``, so every page they touch starts on node 1; a
``/dev/shm`` segment two of them map is first touched there too. What the
kernel did is read back from ``/proc/<pid>/numa_maps`` here, by the test itself.
Moves are rate-limited (32 MiB/s) so that a 256 MiB worker takes seconds: long
enough to watch a move, to bind another worker and to ask ``/healthz`` meanwhile.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
import uuid

import pytest

from ascendbind.errors import ProcessGone
from tests.daemon_harness import metric_value, running_daemon, wait_for
from tests.memworker_client import mem_worker
from tests.numa.conftest import recorded_npu_smi

RATE_GIB = 0.03125  # 32 MiB/s
MIB = 1 << 20
CONFIG = dict(ASCENDBIND_MEMORY_CHECK_SECONDS="1", ASCENDBIND_MEMORY_RERUN_SECONDS="2",
              ASCENDBIND_MEMORY_MOVE_GIB_PER_SECOND=str(RATE_GIB), ASCENDBIND_COMMAND_TIMEOUT_SECONDS="60")
SLOW = 600.0  # seconds: Python in the guest runs tens of times slower than on a host


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """The daemons' environment: eight NPUs on every CPU (the pools split them: NPUs 0-3 on
    node 0, NPUs 4-7 on node 1)."""
    return {**CONFIG, "ASCENDBIND_NPU_SMI": recorded_npu_smi(str(tmp_path_factory.mktemp("npu-smi")), 8, "0-7")}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, config):
    with running_daemon(str(tmp_path_factory.mktemp("daemon")), ready_timeout=SLOW, **config) as d:
        d.wait_discovered(SLOW)
        yield d


_BOUND: list[int] = []  # pids the running test bound (bind()): released after it


@pytest.fixture(autouse=True)
def released(daemon):
    yield
    assert daemon.alive(), daemon.log()[-3000:]
    while _BOUND:
        pid = _BOUND.pop()
        try:
            daemon.client.release(pid)
        except ProcessGone:
            pass  # its worker exited and the daemon dropped it already
    assert "memory move crashed" not in daemon.log()


@pytest.fixture
def segment():
    path = f"/dev/shm/ascendbind-numa-{uuid.uuid4().hex[:8]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


# ------------------------------------------------------------ the kernel's own view

def _fields(line: str) -> dict[int, int]:
    out = {}
    for word in line.split():
        key, _, value = word.partition("=")
        if key[:1] == "N" and key[1:].isdigit() and value.isdigit():
            out[int(key[1:])] = int(value)
    return out


def _page_kib(line: str) -> int:
    return next(int(w.partition("=")[2]) for w in line.split() if w.startswith("kernelpagesize_kB="))


def numa_lines(pid: int) -> list[str]:
    with open(f"/proc/{pid}/numa_maps") as fh:
        return [ln for ln in fh.read().splitlines() if "N" in ln]


def anon_kib(pid: int) -> dict[int, int]:
    """KiB per node of the mappings no file backs (heap, stacks, anonymous mappings)."""
    out: dict[int, int] = {}
    for line in numa_lines(pid):
        if "file=" in line or "kernelpagesize_kB=" not in line:
            continue
        for node, pages in _fields(line).items():
            out[node] = out.get(node, 0) + pages * _page_kib(line)
    return out


def file_pages(pid: int, path: str) -> dict[int, int]:
    """Pages per node of the mapping of ``path`` (a /dev/shm segment, a hugetlbfs file)."""
    out: dict[int, int] = {}
    for line in numa_lines(pid):
        if f"file={path} " in line or line.endswith(f"file={path}"):
            for node, pages in _fields(line).items():
                out[node] = out.get(node, 0) + pages
    return out


def share_on(kib: dict[int, int], node: int) -> float:
    total = sum(kib.values())
    return kib.get(node, 0) / total if total else 0.0


# ------------------------------------------------------------ the daemon's view

def bind(d, pid: int, npu: int, *, release_after: bool = True) -> tuple[dict, float]:
    t0 = time.monotonic()
    status, body = d.curl("POST", "/v1/bind", {"pid": pid, "npu": npu}, timeout=SLOW)
    took = time.monotonic() - t0
    assert status == 200, body
    if release_after:
        _BOUND.append(pid)
    return body, took


def wait_moved(d, pid: int, states=("done",)) -> dict:
    assert wait_for(lambda: d.worker_entry(pid)["memory"]["state"] not in ("pending", "moving"), SLOW), \
        d.worker_entry(pid)
    doc = d.worker_entry(pid)
    assert doc["memory"]["state"] in states, doc["memory"]
    return doc


def counter(d, name: str, **labels: str) -> float:
    return metric_value(d.metrics_text(), name, **labels) or 0.0


def memory_step(answer: dict) -> dict:
    (step,) = [s for s in answer["steps"] if s["step"] == "memory"]
    return step


# ------------------------------------------------------------ tests


class SharingPair:
    """Two workers on two nodes mapping one segment, bound for the whole module (the other
    tests run meanwhile): A on NPU 3 (node 0), B on NPU 7 (node 1). A sampler reads where
    the segment's pages are once a second."""

    def __init__(self, daemon, a, b, segment: str) -> None:
        self.a, self.b, self.segment = a, b, segment
        bind(daemon, a.pid, 3, release_after=False)
        bind(daemon, b.pid, 7, release_after=False)
        wait_moved(daemon, a.pid)
        wait_moved(daemon, b.pid)
        self.baseline = file_pages(a.pid, segment)
        self.checks = counter(daemon, "ascendbind_memory_checks_total", result="measured")
        self.since = time.monotonic()
        self.samples: list[dict[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(file_pages(self.a.pid, self.segment))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module", autouse=True)
def sharing_pair(daemon):
    path = f"/dev/shm/ascendbind-numa-pair-{uuid.uuid4().hex[:8]}"
    try:
        with mem_worker(private_mib=32, shared=[(path, 64)], membind=1) as a, \
                mem_worker(private_mib=16, shared=[(path, 64)], membind=1) as b:
            pair = SharingPair(daemon, a, b, path)
            yield pair
            pair.stop()
    finally:
        if os.path.exists(path):
            os.unlink(path)

def test_private_pages_move_to_the_pools_node_and_shared_pages_stay(daemon, segment):
    with mem_worker(private_mib=64, shared=[(segment, 32)], membind=1) as a, \
            mem_worker(private_mib=8, shared=[(segment, 32)], membind=1) as b:
        seg_before = file_pages(a.pid, segment)
        assert seg_before == {1: 32 * MIB // 4096}, seg_before  # first touched on node 1
        assert share_on(anon_kib(a.pid), 1) > 0.95
        moved_before = counter(daemon, "ascendbind_memory_moved_bytes_total")

        answer, _ = bind(daemon, a.pid, 0)
        step = memory_step(answer)
        assert step["outcome"] == "pending" and step["data"]["target_node"] == 0, step
        doc = wait_moved(daemon, a.pid)

        # the kernel's view: A's private memory on node 0, the segment where it was, for both
        assert share_on(anon_kib(a.pid), 0) >= 0.9, anon_kib(a.pid)
        assert file_pages(a.pid, segment) == seg_before
        assert file_pages(b.pid, segment) == seg_before
        assert share_on(anon_kib(b.pid), 1) > 0.95, "B is not A: nothing of it moved"

        # the daemon's: the step, its figures, the metrics
        assert doc["memory"]["bytes_moved"] >= 60 * MIB and doc["memory"]["target_node"] == 0, doc["memory"]
        assert doc["memory"]["pages_left"].get("failed", 0) == 0
        step = [s for s in doc["steps"] if s["step"] == "memory"][0]
        assert step["outcome"] == "applied" and step["data"]["bytes_moved"] == doc["memory"]["bytes_moved"]
        assert counter(daemon, "ascendbind_memory_moved_bytes_total") - moved_before >= 60 * MIB
        assert wait_for(lambda: daemon.worker_entry(a.pid)["memory_kib_by_node"] is not None, SLOW)
        kib = daemon.worker_entry(a.pid)["memory_kib_by_node"]
        assert int(kib["shared"].get("1", 0)) >= 32 * 1024, kib  # measured beside the ratio, never moved
        assert daemon.worker_entry(a.pid)["memory_local_ratio"] >= 0.9


def test_the_bind_answers_first_then_the_api_and_another_bind_answer_while_pages_move(daemon):
    # 512 MiB at 32 MiB/s: a 16 s move. Half of that was too little in a slow guest: seeing the
    # move part way, /healthz and B's bind (each a client in the emulated guest) took 9 s once
    with mem_worker(private_mib=512, membind=1) as a, mem_worker(private_mib=16, membind=1) as b:
        answer, took = bind(daemon, a.pid, 0)
        # answered, with most pages still on node 1: the answer did not wait for the move
        assert share_on(anon_kib(a.pid), 1) > 0.5, (took, anon_kib(a.pid))
        assert memory_step(answer)["outcome"] == "pending"
        seen = []

        def moving_part_way() -> bool:
            m = daemon.worker_entry(a.pid)["memory"]
            seen.append(m)
            return m["state"] == "moving" and 0 < m["bytes_moved"] < m["bytes_to_move"]

        assert wait_for(moving_part_way, SLOW, interval=0.05), seen[-3:]
        m = seen[-1]
        assert m["why"] == "bind" and m["target_node"] == 0 and m["bytes_to_move"] >= 500 * MIB

        t0 = time.monotonic()
        status, health = daemon.curl("GET", "/healthz")
        health_took, health_at = time.monotonic() - t0, time.time()
        assert status == 200 and health["discovery"] == "ok", health
        answer, b_took = bind(daemon, b.pid, 4)
        b_at = time.time()
        assert answer["npus"] == [4]
        done = wait_moved(daemon, a.pid)["memory"]
        # both answered before A's pages had all moved (the daemon's clock is this guest's)
        assert health_at < done["finished_at"] and b_at < done["finished_at"], (health_at, b_at, done)
        assert share_on(anon_kib(a.pid), 0) >= 0.9
        wait_moved(daemon, b.pid)
        assert share_on(anon_kib(b.pid), 1) > 0.95  # B's pool is node 1: nothing to move
        print(f"A's bind {took:.3f}s with 512 MiB to move; during the move: /healthz {health_took:.3f}s, "
              f"another bind {b_took:.3f}s")


def test_moves_to_one_node_take_turns(daemon):
    # NPUs 0 and 1 both have their pools on node 0: the second move waits for the first
    with mem_worker(private_mib=128, membind=1) as a, mem_worker(private_mib=128, membind=1) as c:
        bind(daemon, a.pid, 0)
        assert wait_for(lambda: daemon.worker_entry(a.pid)["memory"]["state"] == "moving", SLOW)
        bind(daemon, c.pid, 1)
        waiting = daemon.worker_entry(c.pid)["memory"]
        first = wait_moved(daemon, a.pid)["memory"]
        second = wait_moved(daemon, c.pid)["memory"]
        assert waiting["state"] == "pending" or waiting["started_at"] >= first["finished_at"] - 0.5, waiting
        assert second["started_at"] >= first["finished_at"] - 0.5, (first, second)
        assert share_on(anon_kib(c.pid), 0) >= 0.9


def _hugepages(node: int) -> str:
    return f"/sys/devices/system/node/node{node}/hugepages/hugepages-2048kB/nr_hugepages"


@pytest.fixture
def huge_pages(tmp_path):
    """16 free 2 MiB pages on each node, and a hugetlbfs mount; both undone afterwards."""
    before = {}
    for node in (0, 1):
        with open(_hugepages(node)) as fh:
            before[node] = fh.read().strip()
        with open(_hugepages(node), "w") as fh:
            fh.write("16\n")
    mnt = tmp_path / "hugetlbfs"
    mnt.mkdir()
    assert os.system(f"mount -t hugetlbfs none {mnt}") == 0
    try:
        yield str(mnt)
    finally:
        os.system(f"umount {mnt}")
        for node, n in before.items():
            with open(_hugepages(node), "w") as fh:
                fh.write(n + "\n")


def test_private_huge_pages_move_and_shared_ones_stay(daemon, huge_pages):
    shared = os.path.join(huge_pages, "table")
    with mem_worker(private_mib=8, hugetlb_private=4, hugetlb_shared=[(shared, 4)], membind=1) as a, \
            mem_worker(hugetlb_shared=[(shared, 4)], membind=1) as b:
        assert file_pages(a.pid, shared) == {1: 4}
        huge = [ln for ln in numa_lines(a.pid) if " huge " in ln and "anon=" in ln]
        assert huge and all(_fields(ln) == {1: 4} for ln in huge), huge
        bind(daemon, a.pid, 0)
        doc = wait_moved(daemon, a.pid)
        huge = [ln for ln in numa_lines(a.pid) if " huge " in ln and "anon=" in ln]
        assert all(_fields(ln) == {0: 4} for ln in huge), huge  # private huge pages: on node 0
        assert file_pages(a.pid, shared) == {1: 4} and file_pages(b.pid, shared) == {1: 4}
        assert doc["memory"]["bytes_moved"] >= 4 * (2 * MIB)


def test_a_worker_that_exits_mid_move_ends_its_move_and_is_dropped(daemon):
    ended = lambda: sum(counter(daemon, "ascendbind_memory_moves_total", outcome=o)  # noqa: E731
                        for o in ("applied", "skipped", "failed", "cancelled"))
    before = ended()
    with mem_worker(private_mib=256, membind=1) as a:
        bind(daemon, a.pid, 0)
        assert wait_for(lambda: daemon.worker_entry(a.pid)["memory"]["bytes_moved"] > 0, SLOW)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(30)
        pid = a.pid
    assert wait_for(lambda: ended() == before + 1, SLOW), daemon.log()[-2000:]
    assert wait_for(lambda: pid not in {w["pid"] for w in daemon.client.workers()["workers"]}, SLOW)
    moves = [ln for ln in daemon.log().splitlines() if "memory" in ln and f'"pid": {pid}' in ln]
    assert counter(daemon, "ascendbind_memory_moves_total", outcome="failed") == 0, moves
    assert any("pid_gone" in ln or "move_cancelled" in ln for ln in moves), moves
    assert daemon.curl("GET", "/healthz")[0] == 200


def test_a_release_mid_move_cancels_it(daemon):
    before = counter(daemon, "ascendbind_memory_moves_total", outcome="cancelled")
    with mem_worker(private_mib=256, membind=1) as a:
        bind(daemon, a.pid, 0)
        assert wait_for(lambda: daemon.worker_entry(a.pid)["memory"]["bytes_moved"] > 0, SLOW)
        daemon.client.release(a.pid)
        assert wait_for(lambda: counter(daemon, "ascendbind_memory_moves_total", outcome="cancelled")
                        == before + 1, SLOW)
        assert share_on(anon_kib(a.pid), 1) > 0.2, "the release stopped the move part way"
        with open(f"/proc/{a.pid}/status") as fh:
            allowed = [ln for ln in fh if ln.startswith("Cpus_allowed_list:")][0]
        assert allowed.split()[1] == "0-7", allowed  # released: back on every CPU
        with open(os.path.join(daemon.state_dir, "state.json")) as fh:
            assert a.pid not in {w["pid"] for w in json.load(fh)["workers"]}


def test_a_rerun_moves_memory_allocated_off_the_node_after_the_bind(daemon):
    with mem_worker(private_mib=32, membind=1) as a:
        bind(daemon, a.pid, 0)
        wait_moved(daemon, a.pid)
        assert share_on(anon_kib(a.pid), 0) >= 0.9
        moved = counter(daemon, "ascendbind_memory_moved_bytes_total")
        a.alloc(96)  # the worker's policy puts new memory on node 1: locality falls to about 1/4

        def settled() -> bool:
            doc = daemon.worker_entry(a.pid)
            return doc["memory_reruns"] >= 1 and doc["memory"]["state"] == "done" \
                and (doc["memory_local_ratio"] or 0.0) >= 0.9
        # A check that lands while the worker still touches its new pages starts a rerun that
        # moves the pages there by then; the next rerun (its wait doubled, as the first one left
        # the ratio below the threshold) moves the rest.
        assert wait_for(settled, SLOW), daemon.worker_entry(a.pid)
        doc = daemon.worker_entry(a.pid)
        assert doc["memory"]["why"] == "rerun", doc["memory"]
        assert counter(daemon, "ascendbind_memory_moved_bytes_total") - moved >= 80 * MIB
        assert share_on(anon_kib(a.pid), 0) >= 0.9, anon_kib(a.pid)
        assert 1 <= doc["memory_reruns"] <= 3, doc


def test_two_workers_on_two_nodes_sharing_a_segment_never_take_it_from_each_other(daemon, sharing_pair):
    # bound since the module began: at least 60 s of locality checks every second, each
    # free to rerun every 2 s, while the other tests bound, moved and released workers
    p = sharing_pair
    deadline = p.since + 60
    while time.monotonic() < deadline:  # the window the claim is about, not a synchronisation
        assert file_pages(p.a.pid, p.segment) == p.baseline
        time.sleep(1)
    assert len(p.samples) >= 30 and all(sample == p.baseline for sample in p.samples), p.samples[-5:]
    assert counter(daemon, "ascendbind_memory_checks_total", result="measured") - p.checks >= 40
    for w, node in ((p.a, 0), (p.b, 1)):
        doc = daemon.worker_entry(w.pid)
        assert doc["memory_reruns"] == 0 and doc["memory_local_ratio"] >= 0.9, doc
        assert share_on(anon_kib(w.pid), node) >= 0.9
    print(f"segment unchanged over {time.monotonic() - p.since:.0f} s and {len(p.samples)} samples; no rerun")


def test_a_move_cut_short_by_a_daemon_stop_resumes_after_the_restart(daemon):
    # the module's daemon itself is stopped and started again (a daemon start costs a
    # minute in the guest); this test comes last
    with mem_worker(private_mib=256, membind=1) as a:
        bind(daemon, a.pid, 0)
        assert wait_for(lambda: daemon.worker_entry(a.pid)["memory"]["bytes_moved"] > 0, SLOW)
        assert daemon.stop(signal.SIGTERM, timeout=SLOW) == 0
        with open(os.path.join(daemon.state_dir, "state.json")) as fh:
            (record,) = [w for w in json.load(fh)["workers"] if w["pid"] == a.pid]
        assert record["memory_move"] == {"node": 0, "why": "bind"}
        assert share_on(anon_kib(a.pid), 1) > 0.2, "the stop cut the move short"
        daemon.start(wait=False)
        daemon.wait_ready(SLOW)
        m = wait_moved(daemon, a.pid)["memory"]
        assert m["why"] == "restart", m  # the move the first daemon left, started again
        assert share_on(anon_kib(a.pid), 0) >= 0.9
        daemon.client.release(a.pid)
    assert not glob.glob(os.path.join(daemon.state_dir, "*.tmp-*"))
