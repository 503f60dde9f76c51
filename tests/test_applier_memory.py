"""The memory step on this host: what counts as a worker's private pages, read from a
real worker's maps, numa_maps and pagemap, and the step's skip and stop reasons.

Pages moving between nodes needs a kernel with two NUMA nodes: tests/numa/ runs
those in a guest (make test-numa). What this machine shows for real: which pages
of a live process are movable (private, anonymous, exclusive) and which are not
(a ``/dev/shm`` segment another process maps), and move_pages(2) asked where
they are."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from ascendbind.applier.memory import CHUNK_BYTES, MoveCancel, PageMove, memory_target, migrate_memory, pending_memory
from ascendbind.applier.movepages import MovePages
from ascendbind.applier.pagewalk import Cost, Walk, choose, choose_spans
from ascendbind.values.config import Config
from ascendbind.discovery import LiveHost
from ascendbind.discovery.parse.memmap import movable_pages
from ascendbind.discovery.gather.pages import BASE_PAGE, COARSE_MAPPINGS, open_pagemap, read_move_ranges
from ascendbind.values.model import DeviceType, HostFacts, Mode, NpuPlan, Plan, StepResult
from ascendbind.values.reasons import Outcome, Reason
from tests.audit import Reads, thread_reads
from tests.memworker_client import mem_worker
from tests.planner_hosts import one_npu_host
from tests.workers import start_worker


def host(nodes: dict[int, frozenset[int]]) -> HostFacts:
    return one_npu_host(nodes)


def plan(pool=(2, 3, 4, 5, 6)) -> Plan:
    return Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, pool,
                (NpuPlan(0, pool, pool[:2], pool[2:-2], pool[-2:-1], pool[-1:], (0,)),))


TWO_NODES = {0: frozenset(range(4)), 1: frozenset(range(4, 8))}


def test_single_numa_node_host_skips():
    res = migrate_memory(plan(), os.getpid(), host({0: frozenset(range(8))}), Config())
    assert res.outcome is Outcome.SKIPPED and res.reason is Reason.SINGLE_NUMA_NODE


def test_no_numa_info_skips():
    res = migrate_memory(plan(), os.getpid(), host({}), Config())
    assert res.reason is Reason.NO_NUMA_INFO


def test_the_target_is_the_node_of_pool0_and_the_daemon_step_is_pending_there():
    assert memory_target(plan(pool=(5, 6, 7, 4, 3)), host(TWO_NODES)) == 1
    assert memory_target(plan(pool=(2, 3, 4, 5, 6)), host(TWO_NODES)) == 0
    assert isinstance(memory_target(plan(pool=(9, 10, 11)), host(TWO_NODES)), StepResult)  # CPU 9: no node
    step = pending_memory(1)
    assert step.outcome is Outcome.PENDING and step.data["target_node"] == 1 and step.to_json()["outcome"] == "pending"


def _stat_start(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rpartition(")")[2].split()[19])


def test_pagemap_calls_private_pages_movable_and_a_shared_segment_not(tmp_path):
    seg = f"/dev/shm/ascendbind-test-{uuid.uuid4().hex}"
    try:
        with mem_worker(private_mib=8, shared=[(seg, 4)]) as a, mem_worker(shared=[(seg, 4)]) as b:
            assert b.regions["shared"][0]["length"] == 4 << 20
            priv, shared = a.regions["private"][0], a.regions["shared"][0]
            with open_pagemap(LiveHost(), a.pid) as pm:
                def movable(region) -> list[int]:
                    n = region["length"] // BASE_PAGE
                    return movable_pages(pm.entries(region["start"], n), region["start"], BASE_PAGE)

                # every page of the private region was written: present, anonymous, ours alone
                assert len(movable(priv)) == priv["length"] // BASE_PAGE
                # the segment's pages are shmem (file-backed) and mapped by b as well
                assert movable(shared) == []
            # move_pages(2) without MPOL_MF_MOVE_ALL, asked where: every page has a node
            where = MovePages().query(a.pid, [priv["start"] + i * BASE_PAGE for i in range(16)])
            assert all(s >= 0 for s in where), list(where)
    finally:
        if os.path.exists(seg):
            os.unlink(seg)


def test_the_ranges_to_walk_skip_shared_mappings_and_pages_already_there():
    seg = f"/dev/shm/ascendbind-test-{uuid.uuid4().hex}"
    try:
        with mem_worker(private_mib=16, shared=[(seg, 8)]) as a:
            start = _stat_start(a.pid)
            nodes = {int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit()}
            here = read_move_ranges(LiveHost(), a.pid, min(nodes), start_time=start)
            if len(nodes) == 1:
                assert here.ranges == () and here.remote_bytes == 0  # all of it is on the one node
            elsewhere = read_move_ranges(LiveHost(), a.pid, max(nodes) + 1, start_time=start)
            priv, shared = a.regions["private"][0], a.regions["shared"][0]
            starts = {r.start for r in elsewhere.ranges}
            assert priv["start"] in starts and shared["start"] not in starts
            (r,) = [r for r in elsewhere.ranges if r.start == priv["start"]]
            assert r.private_bytes == r.remote_bytes == 16 << 20
            # the residency the ranges came from: the segment is shared, the region private
            assert sum(elsewhere.residency.shared_kib.values()) >= 8 << 10
            assert sum(elsewhere.residency.private_kib.values()) >= 16 << 10
    finally:
        if os.path.exists(seg):
            os.unlink(seg)


def test_a_move_with_nothing_off_the_node_is_applied_and_says_so():
    with mem_worker(private_mib=4) as a:
        nodes = sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit())
        if len(nodes) != 1:
            pytest.skip("this checks a one-node host; tests/numa/ moves pages between nodes")
        res = PageMove(LiveHost(), a.pid, _stat_start(a.pid), nodes[0]).run()
    assert res.outcome is Outcome.APPLIED and "already" in res.detail, res.detail
    assert res.data["bytes_moved"] == 0 and res.data["target_node"] == nodes[0]


def test_a_gone_or_recycled_worker_is_skipped_with_its_reason():
    with start_worker(plain=0, acl=0, release=0) as w:
        pid, start = w.pid, w.start_time
        recycled = PageMove(LiveHost(), pid, start + 1, 0).run()
    assert recycled.outcome is Outcome.SKIPPED and recycled.reason is Reason.PID_RECYCLED
    gone = PageMove(LiveHost(), pid, start, 0).run()
    assert gone.outcome is Outcome.SKIPPED and gone.reason is Reason.PID_GONE and gone.data["bytes_moved"] == 0


def test_a_machine_without_move_pages_skips():
    with start_worker(plain=0, acl=0, release=0) as w:
        res = PageMove(LiveHost(), w.pid, w.start_time, 0, syscall=MovePages(machine="pdp11")).run()
    assert res.outcome is Outcome.SKIPPED and res.reason is Reason.MOVE_UNSUPPORTED


def test_a_cancelled_move_stops_before_its_first_chunk():
    # the ranges must be off the target for the chunk loop to run: name a node the
    # worker's pages are not on (one past the last node)
    nodes = sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit())
    cancel = MoveCancel()
    cancel.set("released")
    with mem_worker(private_mib=4) as a:
        res = PageMove(LiveHost(), a.pid, _stat_start(a.pid), nodes[-1] + 1, cancel=cancel).run()
    assert res.outcome is Outcome.SKIPPED and res.reason is Reason.MOVE_CANCELLED
    assert "released" in res.detail and res.data["bytes_moved"] == 0


def test_a_node_the_kernel_does_not_have_fails_the_move_with_the_error():
    nodes = sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit())
    with mem_worker(private_mib=4) as a:
        res = PageMove(LiveHost(), a.pid, _stat_start(a.pid), nodes[-1] + 1).run()
    # move_pages(2) refuses a node that is not online: ENODEV, the whole call
    assert res.outcome is Outcome.FAILED and res.reason is Reason.MOVE_FAILED, res.detail
    assert "No such device" in res.detail or "ENODEV" in res.detail


def test_a_snapshot_has_no_process_memory_to_move(tmp_path):
    from ascendbind.discovery import SnapshotHost

    with start_worker(plain=0, acl=0, release=0) as w:
        res = PageMove(SnapshotHost(str(tmp_path)), w.pid, w.start_time, 0).run()
    assert res.outcome is Outcome.FAILED and res.reason is Reason.MEMORY_UNREADABLE, res.detail


def test_the_memory_worker_names_its_threads_and_reports_its_regions():
    # the helper the NUMA tests and the bench start under numactl: its threads carry the
    # names the role split looks for, and its regions are where it says they are
    with mem_worker(private_mib=2, threads=("acl_thread", "release_thread")) as a:
        comms = set()
        for tid in os.listdir(f"/proc/{a.pid}/task"):
            with open(f"/proc/{a.pid}/task/{tid}/comm") as fh:
                comms.add(fh.read().strip())
        assert {"acl_thread", "release_thread"} <= comms
        (priv,) = a.regions["private"]
        start, end = priv["start"], priv["start"] + priv["length"]
        # inside one private writable mapping: the kernel may merge the region with an adjacent
        # anonymous mapping of the same protection (older kernels do), so not always one of its own
        with open(f"/proc/{a.pid}/maps") as fh:
            spans = [(int(lo, 16), int(hi, 16), perms) for lo, hi, perms in
                     (line.split()[0].split("-") + [line.split()[1]] for line in fh)]
        assert any(lo <= start and end <= hi and perms == "rw-p" for lo, hi, perms in spans), \
            ("the private region lies in one private writable mapping", hex(start), hex(end), spans)
        assert len(a.steps(2)) == 2


def test_an_exiting_or_gone_process_reads_as_exiting_a_live_one_not():
    from ascendbind.discovery.gather.process import exiting
    from tests.workers import _wait

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # exited, not reaped: a zombie, which has no address space left to move
        assert _wait(lambda: open(f"/proc/{child.pid}/stat").read().rpartition(")")[2].split()[0] == "Z")
        assert exiting(child.pid)
    finally:
        child.wait()
    assert exiting(child.pid)  # reaped: gone
    assert not exiting(os.getpid())


def _off_every_node() -> int:
    """A node no page of this host is on (one past the last): a move there selects every
    private page, and the kernel refuses the first move_pages(2) to it (ENODEV)."""
    return max(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit()) + 1


@pytest.mark.parametrize("mappings", [1500, 5000])  # numa_maps read; past COARSE_MAPPINGS, maps alone
def test_thousands_of_one_page_mappings_are_read_in_a_few_preads_and_batched_into_one_call(mappings):
    with mem_worker(tiny=mappings) as a:
        (tiny,) = a.regions["tiny"]
        pages = {tiny["start"] + i * tiny["stride"] for i in range(tiny["count"])}
        found = read_move_ranges(LiveHost(), a.pid, _off_every_node(), start_time=a.start_time)
        assert found.mappings >= mappings and found.coarse is (found.mappings > COARSE_MAPPINGS)
        chosen = choose_spans(found.spans) if found.coarse else choose(found.ranges)
        assert not chosen.capped
        with open_pagemap(LiveHost(), a.pid) as pm:
            before = thread_reads()
            walk = Walk(pm, chosen.ranges, CHUNK_BYTES)
            batches = [b for b in walk if b is not None]
            reads = thread_reads() - before - 1
        # every mapping walked, through one descriptor, in reads of up to 64 MiB of address
        # space each (the mappings lie 8 KiB apart)
        assert walk.mappings >= mappings and reads == walk.reads <= 12, (reads, walk.reads)
        # the worker's pages of every mapping together: one move_pages(2) call for all of them
        (batch,) = [b for b in batches if b.page == BASE_PAGE]
        got = batch.direct + batch.ask
        assert pages <= set(got) and len(got) <= CHUNK_BYTES // BASE_PAGE
        # numa_maps put them all off that node: moved without asking; read from maps alone: asked first
        assert (batch.ask, batch.direct) == ((got, []) if found.coarse else ([], got))
        with Reads() as calls:
            where = MovePages().query(a.pid, got)
        assert calls.move_pages() == [(a.pid, len(got), -1)]
        assert all(s >= 0 for s in where)  # each a present page of the worker, on some node


def test_the_rate_limit_charges_each_mapping_and_a_worker_of_tiny_ones_is_paced_by_them():
    rate = 1 << 30  # 1 GiB/s: a mapping walked counts as 64 KiB, so 5000 of them take 0.3 s
    out = {}
    for shape, kwargs in (("tiny", {"tiny": 5000}), ("one", {"private_pages": 5000})):
        with mem_worker(**kwargs) as a:
            with Reads() as calls:
                res = PageMove(LiveHost(), a.pid, a.start_time, _off_every_node(), rate=rate).run()
        # the walk ends with one move_pages(2) call for every page, which the kernel
        # refuses whole (no such node): the selection, the walk and the pacing before it ran
        assert res.reason is Reason.MOVE_FAILED and "ENODEV" in res.detail, res.detail
        # one call moves every page (after one asks where they are, for the worker read
        # from maps alone): the last call, which the kernel refused
        *asked, (pid, pages, node) = calls.move_pages()
        assert pid == a.pid and node == _off_every_node() and pages >= 5000
        assert [n for _pid, n, to in asked if to == -1] == ([pages] if shape == "tiny" else [])
        out[shape] = res.data
    tiny, one = out["tiny"], out["one"]
    assert tiny["mappings_walked"] >= 5000 and one["mappings_walked"] < 200
    assert tiny["syscalls"] <= 12 and tiny["pages_considered"] < 4 * 5000 + one["pages_considered"]
    # the same bytes, 5000 mappings more: 5000 x 64 KiB more of the budget, and each move
    # waited for its budget before it called the kernel
    assert tiny["cost_bytes"] - one["cost_bytes"] >= 4900 * Cost.MAPPING
    for data in (tiny, one):
        assert data["seconds"] >= (data["cost_bytes"] - Cost.CALL) / rate, data
    assert tiny["seconds"] >= 4900 * Cost.MAPPING / rate


def test_a_worker_of_many_mappings_past_the_mapping_cap_is_read_from_numa_maps_and_walked_up_to_the_cap():
    # read from maps alone, 5000 mappings are past a cap of 1000: which of them the last
    # move left off the node only numa_maps says, so it is read, and 1000 are walked
    with mem_worker(tiny=5000) as a:
        with Reads() as reads:
            res = PageMove(LiveHost(), a.pid, a.start_time, _off_every_node(), max_mappings=1000).run()
    assert res.reason is Reason.MOVE_FAILED and "ENODEV" in res.detail, res.detail  # the one call, refused
    assert reads.opened(f"/{a.pid}/numa_maps") == 1 and reads.opened(f"/{a.pid}/maps") == 2
    assert res.data["mappings_walked"] == 1000
    (moved,) = [n for _pid, n, to in reads.move_pages() if to != -1]
    assert 1000 <= moved < 5000
