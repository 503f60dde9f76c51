"""maps + numa_maps + pagemap -> which pages of a worker are its own to move. Pure, as tables.

The live counterpart (a real worker's files on this machine) is in
test_applier_memory.py; pages moving between nodes in tests/numa/."""

from __future__ import annotations

import os

import pytest

from ascendbind.discovery import SnapshotHost
from ascendbind.discovery.parse.memmap import (PM_EXCLUSIVE, PM_FILE, PM_PRESENT, PM_SWAPPED, MoveRange, Vma,
                                         move_ranges, movable_pages, parse_maps, writable_anonymous)
from ascendbind.discovery.parse.numa_maps import parse_numa_maps, scan_numa_maps
from ascendbind.discovery.gather.worker import read_numa_residency
from ascendbind.errors import ParseError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_950 = os.path.join(ROOT, "fixtures", "hosts", "950-4numa")

MAPS = """\
55d0c0a00000-55d0c0a80000 r--p 00000000 fd:01 1310 /usr/bin/python3.11
55d0c1000000-55d0c2000000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0040000000 rw-p 00000000 00:00 0
7f0040000000-7f0050000000 rw-s 00000000 00:1a 77 /dev/shm/host table
7f0050000000-7f0050400000 rw-p 00000000 00:0f 9 /anon_hugepage (deleted)
7f0060000000-7f0060001000 rw-p 00002000 fd:01 1311 /usr/lib/libc.so.6
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7ffd00100000-7ffd00102000 r-xp 00000000 00:00 0                          [vdso]
"""

NUMA_MAPS = """\
55d0c0a00000 default file=/usr/bin/python3.11 mapped=60 mapmax=3 N0=60 kernelpagesize_kB=4
55d0c1000000 default heap anon=300 dirty=300 N0=100 N1=200 kernelpagesize_kB=4
7f0000000000 default anon=1000 dirty=1000 N1=1000 kernelpagesize_kB=4
7f0040000000 default file=/dev/shm/host\\040table dirty=4000 mapped=4000 mapmax=2 N1=4000 kernelpagesize_kB=4
7f0050000000 default file=/anon_hugepage\\040(deleted) huge anon=2 dirty=2 N1=2 kernelpagesize_kB=2048
7f0060000000 default file=/usr/lib/libc.so.6 anon=1 dirty=1 N0=1 kernelpagesize_kB=4
7ffd00000000 default stack anon=10 dirty=10 N0=10 kernelpagesize_kB=4
7ffd00100000 default
"""


def test_maps_rows_read_as_the_kernel_prints_them():
    vmas = parse_maps(MAPS)
    assert len(vmas) == 8
    assert vmas[1] == Vma(0x55d0c1000000, 0x55d0c2000000, False, "[heap]")
    assert vmas[2] == Vma(0x7f0000000000, 0x7f0040000000, False, "")
    assert vmas[3].shared and vmas[3].path == "/dev/shm/host table"  # a path with a space
    assert vmas[4].path == "/anon_hugepage (deleted)" and not vmas[4].shared


@pytest.mark.parametrize(("line", "says"), [
    ("zz-7f00 rw-p 0 00:00 0", "bad address range"),
    ("7f00-7e00 rw-p 0 00:00 0", "bad range"),
    ("7f00-7f10 rw-x 0 00:00 0", "bad range or permissions"),
    ("7f00-7f10 rw-p 0", "fewer than five"),
])
def test_malformed_maps_rows_name_the_source_and_line(line, says):
    with pytest.raises(ParseError) as exc:
        parse_maps(MAPS.splitlines()[0] + "\n" + line + "\n", source="/proc/77/maps")
    assert "/proc/77/maps line 2" in str(exc.value) and says in str(exc.value)


def test_numa_maps_split_private_from_shared():
    res = parse_numa_maps(NUMA_MAPS)
    # private: heap 100+200, anon 1000, anon huge 2 x 2 MiB, the libc page it wrote, stack 10
    assert dict(res.private_kib) == {0: 4 * (100 + 1 + 10), 1: 4 * (200 + 1000) + 2 * 2048}
    # shared: the python text, the /dev/shm segment
    assert dict(res.shared_kib) == {0: 4 * 60, 1: 4 * 4000}
    assert {n: res.private_kib.get(n, 0) + res.shared_kib.get(n, 0) for n in res.kib} == dict(res.kib)


def test_a_partly_written_private_file_mapping_is_split_in_proportion():
    # 40 of the mapping's 100 present pages are the process's copies (anon=40)
    res = parse_numa_maps("7f00 default file=/data/x anon=40 dirty=40 mapped=60 N0=50 N1=50 kernelpagesize_kB=4\n")
    assert dict(res.private_kib) == {0: 80, 1: 80} and dict(res.shared_kib) == {0: 120, 1: 120}


def test_the_950_fixture_worker_private_and_shared():
    res = read_numa_residency(SnapshotHost(HOST_950), 5151)
    # hugetlb files, the model file's page cache and library text are shared; heap, anon, stack private
    assert res.private_kib[0] == 4 * (14 + 9 + 160844 + 655360 + 1024 + 4 + 36)
    assert res.shared_kib[2] == 4 * (52 + 16384) + 2048 * 1024
    assert sum(res.private_kib.values()) + sum(res.shared_kib.values()) == res.total_kib


def test_the_ranges_to_move_are_the_private_ones_with_pages_elsewhere():
    def ranges(node):
        return move_ranges(MAPS, scan_numa_maps(NUMA_MAPS, node=node).off_node)

    to0 = {r.start: r for r in ranges(0)}
    # heap (200 pages on node 1), the anonymous mapping, the private huge pages; not the
    # shared segment, not the stack or the libc copy (on node 0 already), not the text
    assert set(to0) == {0x55d0c1000000, 0x7f0000000000, 0x7f0050000000}
    # a third of the heap's pages on node 0 already: where each is, is asked before the move
    assert to0[0x55d0c1000000] == MoveRange(0x55d0c1000000, 0x55d0c2000000, 4096, 300 * 4096, 200 * 4096, True)
    assert not to0[0x7f0000000000].ask  # all of it off node 0: moved straight away
    assert to0[0x7f0050000000].page_size == 2 << 20 and to0[0x7f0050000000].remote_bytes == 4 << 20
    to1 = {r.start for r in ranges(1)}
    assert to1 == {0x55d0c1000000, 0x7f0060000000, 0x7ffd00000000}


def test_a_region_without_its_mapping_and_the_kernels_own_are_left():
    maps = ("00001000-00003000 r-xp 00000000 00:00 0 [vdso]\n"
            "00009000-0000a000 rw-p 00000000 00:00 0\n")
    off = scan_numa_maps("00001000 default anon=2 N1=2 kernelpagesize_kB=4\n"
                         "00005000 default anon=2 N1=2 kernelpagesize_kB=4\n", node=0).off_node  # 5000: no such mapping now
    assert set(off) == {"00001000", "00005000"}
    assert move_ranges(maps, off) == ()


def test_only_the_maps_rows_of_mappings_to_move_are_read_whole():
    # a malformed row of a mapping not to move is passed over (its start finds nothing);
    # one of a mapping to move is an error naming the line
    off = scan_numa_maps("00009000 default anon=2 N1=2 kernelpagesize_kB=4\n", node=0).off_node
    good = "00009000-0000b000 rw-p 00000000 00:00 0\n"
    assert move_ranges("00001000-00003000 rw-x bad\n" + good, off) == (MoveRange(0x9000, 0xb000, 4096, 8192, 8192),)
    with pytest.raises(ParseError, match="line 2"):
        move_ranges("00001000-00002000 rw-p 0 00:00 0\n" + good.replace("rw-p", "rw-q"), off)


def test_a_worker_read_from_maps_alone_walks_its_writable_anonymous_mappings():
    # heap, the anonymous mapping, the stack and a named one; not the file-backed ones
    # (python's data, libc's written page, the private huge pages), the shared segment,
    # a read-only or inaccessible anonymous one, nor the kernel's
    maps = MAPS + ("7f0070000000-7f0070001000 ---p 00000000 00:00 0\n"
                   "7f0070001000-7f0070002000 r--p 00000000 00:00 0\n"
                   "7f0080000000-7f0080010000 rw-p 00000000 00:00 0                          [anon:arena]\n"
                   "zz-7f00 rw-p 0 00:00 0\n")
    assert writable_anonymous(maps) == [(0x55d0c1000000, 0x55d0c2000000, 1), (0x7f0000000000, 0x7f0040000000, 1),
                                        (0x7ffd00000000, 0x7ffd00021000, 1), (0x7f0080000000, 0x7f0080010000, 1)]


def test_writable_anonymous_neighbours_in_one_mib_block_come_as_one_run_with_their_count():
    P = 4096
    base = 0x7f0000000000
    # 200 one-page mappings one page apart: 128 of them end below the 1 MiB boundary at
    # base + 0x100000, the other 72 lie past it
    tiny = "".join(f"{base + 2 * i * P:x}-{base + (2 * i + 1) * P:x} rw-p 00000000 00:00 0 \n" for i in range(200))
    low = ("00010000-00011000 r-xp 00000000 fd:01 3 /bin/w\n"
           "00400000-00401000 rw-p 00000000 00:00 0\n"  # fewer digits: a run of their own
           "00402000-00403000 rw-p 00000000 00:00 0                          [anon:a-b 00:00 0]\n")
    high = ("7f00001ff000-7f0000201000 rw-p 00000000 00:00 0\n"  # across a boundary: alone
            "7f0000300000-7f0000301000 rw-p 00000000 00:00 0\n"
            "7f0000302000-7f0000303000 r--p 00000000 00:00 0\n"  # not writable: ends the run
            "7f0000304000-7f0000305000 rw-p 00000000 00:00 0\n"
            "7f0000306000-7f0000307000 rw-p 00001000 fd:01 12 /usr/lib/x.so\n"  # a file: ends it too
            "7f0000308000-7f0000309000 rw-p 00000000 00:00 0")  # the last line, with no newline
    got = writable_anonymous(low + tiny + high)
    assert got == [(0x400000, 0x403000, 2), (base, base + 255 * P, 128), (base + 256 * P, base + 399 * P, 72),
                   (0x7f00001ff000, 0x7f0000201000, 1), (0x7f0000300000, 0x7f0000301000, 1),
                   (0x7f0000304000, 0x7f0000305000, 1), (0x7f0000308000, 0x7f0000309000, 1)]
    # the same mappings as a scan line by line finds, each in exactly one run
    rows = [v for v in parse_maps(low + tiny + high) if not v.path.startswith("/")]
    assert sum(n for _s, _e, n in got) == len(rows) - 1 == 206  # all but the read-only one


@pytest.mark.parametrize(("entry", "movable"), [
    (PM_PRESENT | PM_EXCLUSIVE | 0x1234, True),  # present, anonymous, ours alone (a PFN in the low bits)
    (PM_PRESENT, False),  # present, anonymous, shared with a forked child
    (PM_PRESENT | PM_FILE | PM_EXCLUSIVE, False),  # a page-cache or shmem page
    (PM_SWAPPED | PM_EXCLUSIVE, False),  # swapped out: nothing to move
    (0, False),  # never touched
])
def test_pagemap_bits(entry, movable):
    assert movable_pages([entry], 0x7f0000000000, 4096) == ([0x7f0000000000] if movable else [])


def test_huge_pages_are_one_address_per_page_from_their_first_entry():
    good = PM_PRESENT | PM_EXCLUSIVE
    entries = [good] * 512 + [0] * 512 + [good] * 512  # three 2 MiB pages of 4 KiB entries
    assert movable_pages(entries, 0x40000000, 2 << 20, stride=512) == [0x40000000, 0x40000000 + (4 << 20)]
