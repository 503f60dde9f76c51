"""The one bounded reader: its limit rule on real files, /proc included."""

from __future__ import annotations

import os
import threading

from ascendbind.discovery.read.bounded import PIECE, read_bounded, task_affinity


def test_at_most_limit_plus_one_bytes_so_an_overlong_file_shows(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * (3 * PIECE + 7))
    assert read_bounded(str(f), 10) == "x" * 11
    assert len(read_bounded(str(f), 2 * PIECE)) == 2 * PIECE + 1  # a piece at a time, past the first
    assert len(read_bounded(str(f))) == 3 * PIECE + 7  # no limit: whole
    assert read_bounded(str(f), 3 * PIECE + 7) == "x" * (3 * PIECE + 7)  # exactly the limit: nothing more to see


def test_text_counts_characters_and_binary_bytes(tmp_path):
    f = tmp_path / "f"
    f.write_text("\u00e9\u4e2d" * 40000, encoding="utf-8")  # 200,000 bytes, several pieces
    assert read_bounded(str(f), 70001) == ("\u00e9\u4e2d" * 40000)[:70002]
    assert read_bounded(str(f), 70001, binary=True) == f.read_bytes()[:70002]
    assert read_bounded(str(f), 80000) == "\u00e9\u4e2d" * 40000  # exactly the limit


def test_single_makes_one_read_and_binary_keeps_the_bytes(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"a\xff\nb")
    assert read_bounded(str(f), binary=True) == b"a\xff\nb"
    assert read_bounded(str(f)) == "a\ufffd\nb"
    assert read_bounded(str(f), 1, single=True) == "a\ufffd"  # one read of 2 bytes
    assert read_bounded(str(f), 2) == "a\ufffd\n"  # characters, decoded as read
    d = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_bounded("f", 100, dir_fd=d, binary=True, single=True) == b"a\xff\nb"
    finally:
        os.close(d)


def test_what_cannot_be_read_is_none(tmp_path):
    assert read_bounded(str(tmp_path / "absent")) is None
    assert read_bounded(str(tmp_path)) is None  # a directory opens, and its read fails
    assert read_bounded(str(tmp_path), single=True) is None


def test_a_long_proc_file_is_read_whole_and_a_short_one_in_one_read():
    whole = read_bounded("/proc/self/maps")
    with open("/proc/self/maps") as fh:  # the reference: a buffered read to the end
        ref = fh.read()
    assert whole.count("\n") >= ref.count("\n") - 2 > 10  # the map may grow by a line between the two reads
    comm = read_bounded(f"/proc/self/task/{threading.get_native_id()}/comm", 64, single=True)
    with open("/proc/thread-self/comm") as fh:
        assert comm == fh.read()


def test_task_affinity_reads_back_what_was_set_on_a_real_thread():
    ready, done = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (ready.set(), done.wait(10)))
    t.start()
    ready.wait(10)
    try:
        one = {min(os.sched_getaffinity(0))}
        os.sched_setaffinity(t.native_id, one)
        assert task_affinity(t.native_id) == one
    finally:
        done.set()
        t.join()
