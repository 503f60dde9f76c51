"""The walk of one memory move, as tables: which mappings one move takes past its caps,
how pagemap reads are shared between mappings, how the pages of many mappings go to
the kernel together, and what each kind of work counts for against the rate limit.

The pagemap the walk reads here is a file of 64-bit entries at the offsets the
kernel's pagemap has them (8 bytes per base page of address space), read with the
same ``pread`` through ``PageMap``; a real worker's is walked in
test_applier_memory.py."""

from __future__ import annotations

import os
import struct

import pytest

from ascendbind.applier.pagewalk import GAP_PAGES, Batch, Chosen, Cost, Walk, choose, choose_spans
from ascendbind.discovery.parse.memmap import (PM_EXCLUSIVE, PM_FILE, PM_PRESENT, PM_SWAPPED, RUN_BLOCK, MoveRange,
                                               movable_pages)
from ascendbind.discovery.gather.pages import BASE_PAGE, PageMap

P = 4096
GOOD = PM_PRESENT | PM_EXCLUSIVE
BASE = 0x10000000  # the first page of the address space these tables use


def R(first: int, pages: int, *, page: int = P, remote: bool = True) -> MoveRange:
    """A mapping of ``pages`` base pages from page number ``first`` (after BASE)."""
    start = BASE + first * P
    size = pages * P
    return MoveRange(start, start + size, page, size, size if remote else size // 2, not remote)


@pytest.fixture
def pagemap(tmp_path):
    """``entries`` {page number after BASE: entry} written where pagemap keeps them; a PageMap over it."""
    made = []

    def make(entries: dict[int, int]) -> PageMap:
        path = tmp_path / f"pagemap-{len(made)}"
        with open(path, "wb") as fh:
            for page, entry in entries.items():
                fh.seek((BASE // P + page) * 8)
                fh.write(struct.pack("<Q", entry))
        pm = PageMap(os.open(path, os.O_RDONLY))
        made.append(pm)
        return pm

    yield make
    for pm in made:
        pm.close()


def test_a_move_within_its_caps_walks_every_mapping():
    ranges = (R(0, 4), R(10, 1))
    assert choose(ranges, max_mappings=2, max_pages=5) == Chosen(ranges)


def test_past_the_mapping_cap_the_ones_with_most_bytes_off_the_node_are_walked_first():
    small = tuple(R(2 * i, 1) for i in range(10))
    big = R(100, 50)
    got = choose((*small, big), max_mappings=4, max_pages=1000)
    assert got.ranges == (small[0], small[1], small[2], big)  # back in address order
    assert got.left_mappings == 7 and got.left_bytes == 7 * P and got.cut == 0 and got.capped


def test_past_the_page_cap_the_last_mapping_taken_is_cut_short_in_whole_pages():
    huge = R(0, 4 * 512, page=2 << 20)  # four 2 MiB pages
    small, other = R(5000, 10), R(6000, 200)
    got = choose((huge, small, other), max_mappings=10, max_pages=2 * 512 + 100)
    # the most bytes off the node first: the huge pages, of which two whole ones fit; the rest is left
    assert got.ranges == (huge._replace(end=huge.start + 2 * (2 << 20)),)
    assert got.cut == 1 and got.left_mappings == 2
    assert got.left_bytes == huge.remote_bytes // 2 + other.remote_bytes + small.remote_bytes


def test_a_worker_read_from_maps_alone_walks_neighbours_as_one_and_its_biggest_mappings_past_the_caps():
    tiny = [(BASE + 2 * i * P, BASE + (2 * i + 1) * P, 1) for i in range(100)]  # one page, one page apart
    apart = (BASE + (400 + GAP_PAGES + 1) * P, BASE + (400 + GAP_PAGES + 9) * P, 1)  # 8 pages, past the gap
    got = choose_spans([*tiny, apart])
    assert got.ranges == (MoveRange(tiny[0][0], tiny[-1][1], P, 199 * P, 199 * P, True, 100),
                          MoveRange(*apart[:2], P, 8 * P, 8 * P, True, 1)) and not got.capped
    capped = choose_spans([*tiny, apart], max_mappings=11, max_pages=1000)
    assert [r.mappings for r in capped.ranges] == [10, 1]  # the big one, and the first ten alike
    assert capped.left_mappings == 90 and capped.left_bytes == 90 * P
    cut = choose_spans([*tiny, apart], max_mappings=1000, max_pages=5)
    assert cut.ranges == (MoveRange(apart[0], apart[0] + 5 * P, P, 5 * P, 5 * P, True, 1),)
    assert cut.cut == 1 and cut.left_mappings == 100 and cut.left_bytes == 100 * P + 3 * P


def test_runs_of_neighbours_count_every_mapping_they_hold_in_the_walk_and_against_the_cap():
    # two runs of one-page mappings (memmap.writable_anonymous), each one 1 MiB block's; a run
    # spans less than the gap a read spans, so runs are merged as their mappings were
    assert RUN_BLOCK <= GAP_PAGES * BASE_PAGE
    runs = [(BASE, BASE + 255 * P, 128), (BASE + 256 * P, BASE + 399 * P, 72)]
    got = choose_spans(runs)
    assert got.ranges == (MoveRange(BASE, BASE + 399 * P, P, 399 * P, 399 * P, True, 200),) and not got.capped
    assert not choose_spans(runs, max_mappings=200).capped
    capped = choose_spans(runs, max_mappings=150)
    assert [r.mappings for r in capped.ranges] == [128] and capped.left_mappings == 72
    assert capped.left_bytes == 143 * P


def test_mappings_close_together_share_a_read_and_their_pages_one_batch(pagemap):
    # 200 one-page mappings one page apart, then one far beyond the gap a read spans
    entries = {2 * i: GOOD for i in range(200)}
    far = 2 * 200 + GAP_PAGES + 10
    entries[far] = GOOD
    ranges = [R(2 * i, 1) for i in range(200)] + [R(far, 1)]
    walk = Walk(pagemap(entries), ranges, 64 << 20)
    batches = [b for b in walk if b is not None]
    assert walk.reads == 2 and walk.mappings == 201
    assert batches == [Batch(P, [BASE + 2 * i * P for i in range(200)] + [BASE + far * P], [])]
    assert walk.entries == 2 * 199 + 1 + 1


def test_a_batch_holds_one_chunk_of_pages_of_one_size_and_asks_where_mixed_mappings_are(pagemap):
    chunk = 8 * P  # eight base pages a call
    entries = {i: GOOD for i in range(20)}
    entries[3] = PM_PRESENT  # shared with a forked child: not exclusive
    entries[4] = PM_PRESENT | PM_FILE | PM_EXCLUSIVE  # a page-cache page
    entries.update({1000 + 512 * k: GOOD for k in range(3)})  # three 2 MiB pages
    ranges = [R(0, 10), R(10, 10, remote=False), R(1000, 3 * 512, page=2 << 20)]
    walk = Walk(pagemap(entries), ranges, chunk)
    got = [b for b in walk if b is not None]
    small = [b for b in got if b.page == P]
    # 18 movable base pages: at most 8 a call, the mixed mapping's asked about first
    assert [len(b.direct) + len(b.ask) for b in small] == [8, 8, 2]
    assert sorted(a for b in small for a in b.direct) == [BASE + i * P for i in range(10) if i not in (3, 4)]
    assert sorted(a for b in small for a in b.ask) == [BASE + i * P for i in range(10, 20)]
    # a huge page is one address, from its first entry; a chunk of 8 base pages still takes one
    huge = [b for b in got if b.page == 2 << 20]
    assert [b.direct for b in huge] == [[BASE + (1000 + 512 * k) * P] for k in range(3)]
    assert walk.mappings == 3


def test_the_walk_picks_the_pages_the_pagemap_bits_call_movable(pagemap):
    # every combination of the bits that matter and some that do not (soft-dirty, 55;
    # a page frame number in the low bits), each at its own page of one mapping
    bits = [PM_PRESENT, PM_SWAPPED, PM_FILE, PM_EXCLUSIVE, 1 << 55, 0x12345]
    entries = {}
    for k in range(1 << len(bits)):
        entries[k] = sum(b for j, b in enumerate(bits) if k >> j & 1)
    walk = Walk(pagemap(entries), [R(0, len(entries))], 64 << 20)
    (batch,) = [b for b in walk if b is not None]
    table = [entries[k] for k in range(len(entries))]
    assert batch.direct == movable_pages(table, BASE, P) and len(batch.direct) == 2 * 2 * 2  # 3 free bits


def test_a_process_gone_mid_walk_reads_nothing_and_batches_nothing(pagemap):
    pm = pagemap({0: GOOD})
    pm.close()  # reads now fail, as a gone process's pagemap does
    walk = Walk(pm, [R(0, 1), R(5000, 3)], 64 << 20)
    assert [b for b in walk if b is not None] == [] and walk.mappings == 2


@pytest.mark.parametrize(("work", "budget"), [
    (Cost(moved=64 << 20), 64 << 20),  # bytes moved: themselves
    (Cost(mappings=10000), 10000 * (64 << 10)),  # ten thousand mappings walked: 625 MiB
    (Cost(lines=10000), 10000 * (4 << 10)),
    (Cost(entries=16384, calls=2), 16384 * 128 + 2 * (256 << 10)),
    # one 64 MiB mapping moved in one chunk: about 4 % over its bytes
    (Cost(moved=64 << 20, lines=1, mappings=1, entries=16384, calls=2), (64 << 20) + 4096 + 65536 + 16384 * 128 + 524288),
])
def test_the_cost_model_counts_each_kind_of_work_in_bytes(work, budget):
    assert work.budget == budget
