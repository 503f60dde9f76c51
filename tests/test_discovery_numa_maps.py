"""numa_maps -> resident memory per NUMA node, and the locality ratio.

The 4-node case is the 950 fixture host's NPU0 worker (fixtures/hosts/950-4numa,
proc/5151/numa_maps: 4 KiB pages, two hugetlb mappings of 2 MiB pages, lines with
nothing resident, a model path with spaces); the live case is a real worker's
numa_maps on this machine, read through the same HostSource as the daemon.
"""

from __future__ import annotations

import os
import tracemalloc

import pytest

from ascendbind.discovery import LiveHost, SnapshotHost
from ascendbind.discovery.parse.numa_maps import local_ratio, parse_numa_maps, scan_numa_maps
from ascendbind.discovery.gather.worker import read_numa_residency
from ascendbind.errors import DiscoveryError, ParseError, ProcessGone
from tests.workers import online_nodes, start_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_950 = os.path.join(ROOT, "fixtures", "hosts", "950-4numa")

# the fixture's lines, node -> pages, per page size (KiB); summed by hand from the file
FIXTURE_4K = {
    0: 690 + 16 + 9 + 160844 + 655360 + 1024 + 16384 + 1873 + 340 + 4 + 36,
    1: 20389 + 131072 + 1024 + 16384 + 62,
    2: 52 + 1024 + 16384,
    3: 1024 + 16384,
}
FIXTURE_2M = {0: 512, 2: 1024, 3: 512}


def test_the_4_node_fixture_worker_per_node_in_pages_and_in_bytes():
    res = read_numa_residency(SnapshotHost(HOST_950), 5151)
    assert dict(res.pages) == {n: FIXTURE_4K[n] + FIXTURE_2M.get(n, 0) for n in range(4)}
    assert dict(res.kib) == {n: 4 * FIXTURE_4K[n] + 2048 * FIXTURE_2M.get(n, 0) for n in range(4)}
    assert res.total_kib == sum(res.kib.values())


def test_the_scan_a_move_reads_sums_to_the_residency_of_the_whole_file():
    with open(os.path.join(HOST_950, "proc", "5151", "numa_maps")) as fh:
        text = fh.read()
    whole = parse_numa_maps(text)
    assert sum(whole.private_kib.values()) and sum(whole.shared_kib.values())  # both kinds to add up
    for node in range(5):
        scan = scan_numa_maps(text, node=node)
        assert scan.residency == whole and scan.lines == len(text.splitlines())
        # what it finds off the node adds up to the private memory elsewhere
        assert sum(o.remote_bytes for o in scan.off_node.values()) == \
            1024 * sum(v for n, v in whole.private_kib.items() if n != node)
    assert scan_numa_maps("").residency == parse_numa_maps("")


def test_lines_alike_but_for_their_address_add_up_as_many_mappings():
    # an allocator's one-page mappings: 5000 lines alike, read once, counted 5000 times;
    # past the bound on distinct lines kept, lines still count once each
    same = "".join(f"{0x7f0000000000 + 2 * i * 4096:x} default anon=1 dirty=1 N1=1 kernelpagesize_kB=4\n"
                   for i in range(5000))
    distinct = "".join(f"{0x7e0000000000 + 2 * i * 4096:x} default anon={i + 1} dirty={i + 1} N{i % 2}={i + 1} "
                       f"kernelpagesize_kB=4\n" for i in range(5000))
    scan = scan_numa_maps(same + distinct, node=0)
    odd = sum(i + 1 for i in range(5000) if i % 2)
    even = sum(i + 1 for i in range(5000) if i % 2 == 0)
    assert dict(scan.residency.private_kib) == {0: 4 * even, 1: 4 * (5000 + odd)}
    assert len(scan.off_node) == 5000 + 2500 and scan.lines == 10000
    assert scan.off_node["7f0000000000"] == (4096, 4096, 4096)


def test_a_numa_maps_longer_than_the_limit_is_refused_not_held():
    with pytest.raises(DiscoveryError) as exc:
        read_numa_residency(SnapshotHost(HOST_950), 5151, limit=1000)
    assert exc.value.code == "too_large" and "longer than 1000" in str(exc.value)
    size = os.path.getsize(os.path.join(HOST_950, "proc", "5151", "numa_maps"))
    assert read_numa_residency(SnapshotHost(HOST_950), 5151, limit=size).total_kib > 0  # exactly the limit: fine
    with start_worker(plain=0, acl=0, release=0) as w:
        with pytest.raises(DiscoveryError, match="longer than 200"):
            read_numa_residency(LiveHost(), w.pid, limit=200)


def test_a_bounded_read_of_a_long_file_reads_it_whole_up_to_one_character_past_the_limit(tmp_path):
    # a file of several read pieces, with characters of more than one byte: the bound counts
    # characters, one past it is returned so the caller can tell the file is longer
    text = "".join(f"{i:06x}-\u00e9\u4e2d anon=1 N1=1\n" for i in range(20000))
    path = tmp_path / "maps"
    path.write_text(text, encoding="utf-8")
    host = LiveHost()
    assert len(text.encode()) > 4 * (64 << 10)
    assert host.read(str(path)) == text
    assert host.read(str(path), limit=len(text)) == text
    assert host.read(str(path), limit=len(text) - 1) == text  # all of it: one past the limit
    assert host.read(str(path), limit=100000) == text[:100001]


def test_a_bounded_read_holds_about_the_file_not_the_bound(tmp_path):
    # a /proc read bounded at 32 MiB must not ask for 32 MiB: a text read(n) hands n to its
    # buffer at every chunk, and a seq_file (maps of a worker of tiny mappings) comes a page a
    # read, so each page cost a fresh mapping of the bound's size
    text = "".join(f"{i:08x}-{i + 1:08x} rw-p 00000000 00:00 0\n" for i in range(8000))
    path = tmp_path / "maps"
    path.write_text(text, encoding="ascii")
    host = LiveHost()
    tracemalloc.start()
    try:
        got = host.read(str(path), limit=32 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == text
    assert peak < 8 * len(text), f"{peak} bytes held to read {len(text)}"


def test_the_ratio_is_of_bytes_so_remote_huge_pages_are_not_hidden():
    # the NPU0 worker's pool is on node 0; 3 GiB of its hugetlb memory sit on nodes 2-3
    res = read_numa_residency(SnapshotHost(HOST_950), 5151)
    by_bytes = local_ratio(res.kib, {0})
    by_pages = local_ratio(res.pages, {0})
    assert by_bytes == pytest.approx(res.kib[0] / sum(res.kib.values()))
    assert by_bytes < 0.8 <= by_pages, (by_bytes, by_pages)  # raw counts would call this worker local
    assert local_ratio(res.kib, {0, 1, 2, 3}) == 1.0


@pytest.mark.parametrize(
    ("kib", "nodes", "expected"),
    [
        ({0: 300, 1: 100}, {1}, 0.25),  # pool on node 1 of two
        ({0: 300, 1: 100}, {0, 1}, 1.0),  # pool spanning both (topo_affinity extends to the next node)
        ({0: 300, 1: 100}, {2}, 0.0),  # pool on a node holding none of it
        ({1: 100}, {1}, 1.0),
        ({0: 1, 1: 1, 2: 1, 3: 1}, {2, 3}, 0.5),
        ({}, {0}, None),  # nothing resident: no ratio at all, not 1 and not 0
        ({0: 0, 1: 0}, {0}, None),
        ({0: 5}, set(), 0.0),  # a plan without NUMA info: nothing counts as local
    ],
)
def test_local_ratio(kib, nodes, expected):
    assert local_ratio(kib, nodes) == expected


def test_a_path_with_spaces_and_field_like_words_is_not_counted():
    text = ("7f0000000000 default file=/srv/models/my model N9=777 v2.bin mapped=3 mapmax=2 N0=2 N1=1 "
            "kernelpagesize_kB=4\n")
    res = parse_numa_maps(text)
    assert dict(res.pages) == {0: 2, 1: 1} and dict(res.kib) == {0: 8, 1: 4}


def test_lines_with_nothing_resident_count_nothing():
    text = ("ffff30000000 default file=/usr/lib64/libascendcl.so\n"
            "ffff31200000 default\n"
            "ffff40000000 default file=/dev/davinci0\n"
            "\n")
    res = parse_numa_maps(text)
    assert dict(res.kib) == {} and res.total_kib == 0
    assert local_ratio(res.kib, {0}) is None


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("zz default N0=1 kernelpagesize_kB=4", "hex address"),
        ("7f0000000000", "no memory policy"),
        ("7f0000000000 default anon=1 N0=x kernelpagesize_kB=4", "bad field 'N0=x'"),
        ("7f0000000000 default anon=1 N0=1 kernelpagesize_kB=", "bad field 'kernelpagesize_kB='"),
        ("7f0000000000 default anon=1 N0=1 kernelpagesize_kB=0", "bad field"),
        ("7f0000000000 default anon=1 N0=1", "without kernelpagesize_kB"),
        ("7f0000000000 default anon=2 N0=1 N0=1 kernelpagesize_kB=4", "N0 printed twice"),
    ],
)
def test_malformed_lines_name_the_source_and_line(line, says):
    good = "55d0c0a00000 default file=/usr/bin/python3.11 mapped=60 N0=60 kernelpagesize_kB=4\n"
    with pytest.raises(ParseError) as exc:
        parse_numa_maps(good + line + "\n", source="/proc/4242/numa_maps")
    assert "/proc/4242/numa_maps line 2" in str(exc.value) and says in str(exc.value)


def test_a_real_workers_numa_maps_through_the_live_host():
    nodes = online_nodes()
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
    with start_worker(plain=1, acl=0, release=0) as w:
        res = read_numa_residency(LiveHost(), w.pid, start_time=w.start_time)
        with pytest.raises(ProcessGone) as exc:
            read_numa_residency(LiveHost(), w.pid, start_time=w.start_time + 1)
        assert exc.value.code == "pid_recycled"
        pid = w.pid
    assert res.total_kib > 0 and set(res.kib) <= nodes
    for node, pages in res.pages.items():
        assert res.kib[node] >= pages * page_kib  # huge pages only ever add
    # every resident byte is on some online node; on a one-node host that node holds it all
    assert local_ratio(res.kib, nodes) == 1.0
    if len(nodes) == 1:
        assert local_ratio(res.kib, {min(nodes)}) == 1.0
    with pytest.raises(DiscoveryError, match=f"/proc/{pid}/numa_maps"):
        read_numa_residency(LiveHost(), pid)
