"""What a worker writes, read at a bounded cost: its Ascend variables, its environment, and
reads of its files that may never answer; and the numbers in tools' output, in ASCII
digits only.

The parsers are fed the hostile values themselves (128 KiB of ranges, other scripts'
digits); the environment is a real process's, exec'd with a raw list (a key twice,
entries past the cap) or rewritten through /proc/self/mem into one multi-MB value
(tests/hostile_workers.py); the readers (discovery/read/deadline.py) block for real, on a
FIFO nobody opens for writing (the open waits in the kernel until someone does).
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc

import pytest

from ascendbind.values.cpulist import MAX_CPU, parse_cpulist
from ascendbind.values.digits import ascii_int, is_ascii_digits
from ascendbind.discovery.parse.cells import count
from ascendbind.discovery.read.deadline import Readers
from ascendbind.discovery.gather.process import observe_process
from ascendbind.discovery.parse.numa_maps import parse_numa_maps
from ascendbind.discovery.parse.procfs import ENVIRON_LIMIT, cut_environ, parse_environ, parse_ps_te
from ascendbind.discovery.read.sources import LiveHost
from ascendbind.discovery.read.tasks import read_environ
from ascendbind.errors import DiscoveryError, ParseError
from ascendbind.planner.npus.ascend_env import MAX_ID, parse_rt_visible_devices, parse_visible_devices
from tests.daemon_harness import wait_for
from tests.hostile_workers import raw_environ_worker, rewritten_environ_worker

KIB128 = 128 * 1024

# ------------------------------------------------------------ the Ascend variables


@pytest.mark.parametrize("value", [
    ",".join(["0-4096"] * (KIB128 // 7)),   # the attack: every range as wide as the id limit allows
    ",".join(["4096"] * (KIB128 // 5)),     # one id, named over and over
    "1," * (KIB128 // 2),                   # the same, shorter
    "Ascend" + "9" * KIB128,                # a chip name that never comes to its id
    " ," * (KIB128 // 2),                   # blanks
    "0-" + "1" * KIB128,                    # a range with a huge end
], ids=["ranges", "ids", "ones", "long-name", "blanks", "huge-end"])
def test_a_128_kib_value_is_parsed_in_milliseconds_not_seconds(value):
    # before: ~3.8 CPU-s for the ranges (every range expanded, the maximum recomputed per item)
    started = time.process_time()
    with pytest.raises(ValueError, match="ASCEND_VISIBLE_DEVICES"):
        parse_visible_devices(value)
    assert time.process_time() - started < 0.25


def test_the_ids_a_value_names_are_counted_before_a_range_is_expanded():
    assert len(parse_visible_devices(f"0-{MAX_ID}")) == MAX_ID + 1
    assert len(parse_visible_devices(f"0-2000,2001-{MAX_ID}")) == MAX_ID + 1
    with pytest.raises(ValueError, match=f"names more than {MAX_ID + 1} ids"):
        parse_visible_devices(f"0-{MAX_ID},7")
    with pytest.raises(ValueError, match=f"id {MAX_ID + 1} is out of range"):
        parse_visible_devices(f"0-{MAX_ID + 1}")
    with pytest.raises(ValueError, match="runs backwards"):
        parse_visible_devices("5-3")


@pytest.mark.parametrize("value", ["٣", "５", "²", "3,٣", "npu-٣", "Ascend910-５", "٣-5", "1-٥", "+3", "3_0", "-1"])
def test_ids_in_anything_but_ascii_digits_are_refused_naming_the_item(value):
    with pytest.raises(ValueError, match="ASCII digits only"):
        parse_visible_devices(value)


@pytest.mark.parametrize("value", ["٣", "0,５", "²", "+1", "1_0", f"{MAX_ID + 1}"])
def test_rt_visible_devices_takes_ascii_digits_within_the_limit_only(value):
    with pytest.raises(ValueError, match="ASCEND_RT_VISIBLE_DEVICES"):
        parse_rt_visible_devices(value)


def test_rt_visible_devices_of_every_index_is_linear():
    value = ",".join(str(i) for i in range(MAX_ID + 1))
    started = time.process_time()
    assert parse_rt_visible_devices(value) == tuple(range(MAX_ID + 1))
    assert time.process_time() - started < 0.25
    with pytest.raises(ValueError, match="twice"):
        parse_rt_visible_devices(value + ",0")


def test_ascii_digits_are_the_only_digits():
    assert is_ascii_digits("0123456789") and ascii_int("0042") == 42
    for text in ("", "٣", "５", "²", "+1", " 1", "1_0", "1.0", "1e3"):
        assert not is_ascii_digits(text) and ascii_int(text) is None, text


# ------------------------------------------------------------ the environment


def test_a_key_given_twice_reads_as_the_workers_own_getenv_first_one_wins():
    for first, second in (("5", "3"), ("3", "5")):
        env = [f"ASCEND_VISIBLE_DEVICES={first}", "OTHER=1", f"ASCEND_VISIBLE_DEVICES={second}"]
        with raw_environ_worker(env, "ASCEND_VISIBLE_DEVICES") as (w, getenv):
            with open(f"/proc/{w.pid}/environ", "rb") as fh:
                assert fh.read().count(b"ASCEND_VISIBLE_DEVICES=") == 2  # the kernel keeps both
            assert getenv == f"={first}"
            assert observe_process(LiveHost(), w.pid).environ["ASCEND_VISIBLE_DEVICES"] == first
            assert read_environ(w.pid)["ASCEND_VISIBLE_DEVICES"] == first
    assert parse_environ("A=1\0B=2\0A=3\0") == {"A": "1", "B": "2"}


def test_an_environ_past_the_cap_keeps_its_complete_entries_and_says_so():
    env = ["ASCEND_VISIBLE_DEVICES=5"]
    # three 100 KB entries: the third crosses the 256 KiB cap, the one after lies past it
    with raw_environ_worker([*env], "ASCEND_RT_VISIBLE_DEVICES", pads=3, pad_size=100_000) as (w, _):
        view = observe_process(LiveHost(), w.pid)
        assert view.environ["ASCEND_VISIBLE_DEVICES"] == "5"
        assert set(view.environ) == {"ASCEND_VISIBLE_DEVICES", "PAD0", "PAD1"}  # PAD2 is cut: not a short value
        (warning,) = view.warnings
        assert f"/proc/{w.pid}/environ longer than the {ENVIRON_LIMIT}-byte cap" in warning
        assert "first 3 complete entries" in warning
        assert set(read_environ(w.pid)) == set(view.environ)
    assert cut_environ("A=1\0B=2\0", 100) == ("A=1\0B=2\0", None)
    assert cut_environ("A=1\0B=2", 100)[0] == "A=1\0"  # an entry without its NUL is not read


def test_a_multi_mb_environ_costs_a_read_of_the_cap_only():
    with rewritten_environ_worker(6 << 20) as (w, size):
        assert size > 5 << 20
        with open(f"/proc/{w.pid}/environ", "rb") as fh:
            assert fh.read(40) == b"ASCEND_VISIBLE_DEVICES=0-4096,0-4096,0-4"
        tracemalloc.start()
        try:
            started = time.process_time()
            view = observe_process(LiveHost(), w.pid)
            cpu = time.process_time() - started
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # the one entry runs past the cap: nothing of it is used
        assert dict(view.environ) == {} and "first 0 complete entries" in view.warnings[0]
        assert peak < 4 * ENVIRON_LIMIT, peak  # the cap, decoded, and the view: not megabytes
        assert cpu < 0.5


# ------------------------------------------------------------ reads that never answer


class Fifo:
    """A FIFO nobody opens for writing: opening it for reading waits in the kernel until
    ``release`` opens the other end."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.mkfifo(path)

    def read(self) -> bytes:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.read(fd, 16)
        finally:
            os.close(fd)

    def release(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)  # succeeds once a reader waits
        os.write(fd, b"late")
        os.close(fd)


def test_a_read_that_blocks_is_left_behind_at_its_deadline_then_frees_its_thread(tmp_path):
    readers = Readers(deadline=0.3)
    fifo = Fifo(str(tmp_path / "dev"))
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match="did not answer within 0.3 s") as exc:
        readers.read("dev", "/proc/42/root/dev", fifo.read, worker=42, owner=1000)
    assert exc.value.code == "read_timeout" and "/proc/42/root/dev" in str(exc.value)
    assert 0.3 <= time.monotonic() - started < 2.0
    stats = readers.stats()
    assert stats.abandoned["dev"] == 1 and stats.stuck["dev"] == 1 and readers.threads() == 1
    fifo.release()
    assert wait_for(lambda: readers.stats().stuck["dev"] == 0, 10)
    assert readers.read("dev", "x", lambda: "fine", worker=42) == "fine"  # the worker is read again
    assert readers.threads() == 1  # on the same thread
    assert readers.stats().abandoned["dev"] == 1


def test_a_worker_with_a_stuck_read_is_refused_at_once_and_others_are_read(tmp_path):
    readers = Readers(deadline=0.3)
    fifo = Fifo(str(tmp_path / "environ"))
    with pytest.raises(DiscoveryError):
        readers.read("environ", "/proc/42/environ", fifo.read, worker=42, owner=1000)
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match="a read of /proc/42/environ has not returned") as exc:
        readers.read("dev", "/proc/42/root/dev", lambda: "never run", worker=42, owner=1000)
    assert exc.value.code == "read_timeout" and time.monotonic() - started < 0.1
    assert readers.read("environ", "/proc/43/environ", lambda: "A=1\0", worker=43, owner=1000) == "A=1\0"
    assert readers.stats().refused == {"environ": 0, "cmdline": 0, "dev": 1, "root": 0}
    fifo.release()


def test_reads_of_one_worker_take_turns_and_one_that_waits_past_its_deadline_is_refused(tmp_path):
    readers = Readers(deadline=0.5)
    fifo = Fifo(str(tmp_path / "environ"))
    errors = []

    def read_first():
        try:
            readers.read("environ", "/proc/42/environ", fifo.read, worker=42)
        except DiscoveryError as exc:
            errors.append(exc)

    first = threading.Thread(target=read_first)
    first.start()
    assert wait_for(lambda: readers.threads() == 1, 5, interval=0.01)
    ran = []
    with pytest.raises(DiscoveryError, match="has not returned"):
        readers.read("environ", "/proc/42/environ", lambda: ran.append(1), worker=42)
    first.join()
    assert "did not answer" in str(errors[0])
    assert ran == [] and readers.threads() == 1  # it never started a second thread for that worker
    fifo.release()


def test_stuck_reads_are_capped_per_owner_and_in_all_then_refused_at_once(tmp_path):
    readers = Readers(deadline=0.2, per_owner=2, max_stuck=3)
    fifos = [Fifo(str(tmp_path / f"f{i}")) for i in range(3)]
    try:
        for pid, fifo in zip((1, 2), fifos):
            with pytest.raises(DiscoveryError, match="did not answer"):
                readers.read("dev", f"/proc/{pid}/root/dev", fifo.read, worker=pid, owner=1000)
        with pytest.raises(DiscoveryError, match="2 reads of uid 1000's processes are stuck"):
            readers.read("dev", "/proc/3/root/dev", lambda: "never run", worker=3, owner=1000)
        assert readers.read("dev", "/proc/4/root/dev", lambda: "other owner", worker=4, owner=0) == "other owner"
        with pytest.raises(DiscoveryError, match="did not answer"):
            readers.read("dev", "/proc/5/root/dev", fifos[2].read, worker=5, owner=0)
        with pytest.raises(DiscoveryError, match="3 reads of workers' files are stuck"):
            readers.read("dev", "/proc/6/root/dev", lambda: "never run", worker=6, owner=7)
        assert readers.threads() == 3 and readers.stats().refused["dev"] == 2
    finally:
        for fifo in fifos:
            fifo.release()
    assert wait_for(lambda: readers.stats().stuck["dev"] == 0, 10)
    assert readers.read("dev", "/proc/6/root/dev", lambda: "now", worker=6, owner=7) == "now"


# ------------------------------------------------------------ tools' output


@pytest.mark.parametrize("cell", ["٣", "５", "²", "+3", "3_0", "1e3"])
def test_a_tools_number_in_anything_but_ascii_digits_is_a_parse_error(cell):
    with pytest.raises(ParseError, match="is not a number"):
        count(cell, "npu-smi info -m", "NPU ID", 3, f"| {cell} |")
    with pytest.raises(ParseError, match="not a number"):
        parse_ps_te(f"PID SPID TTY TIME CMD\n{cell} 12 ? 00:00:00 python3\n")
    with pytest.raises(ValueError, match="bad item"):
        parse_cpulist(f"0-{cell}")
    assert count(" 7 ", "x", "NPU ID", 1, "x") == 7
    with pytest.raises(ParseError, match="is negative"):
        count("-1", "x", "NPU ID", 1, "x")


def test_a_cpulist_past_the_cpu_limit_is_refused_before_it_is_expanded():
    started = time.process_time()
    for text in ("0-99999999", f"0-{MAX_CPU},0", ",".join(["0-60000"] * 20_000)):
        with pytest.raises(ValueError, match="past the largest CPU number|names more than"):
            parse_cpulist(text)
    assert time.process_time() - started < 0.5
    assert len(parse_cpulist(f"0-{MAX_CPU}")) == MAX_CPU + 1


def test_a_numa_maps_field_in_another_scripts_digits_is_not_counted():
    # the kernel prints its fields in ASCII; a word that only looks like one ends them
    res = parse_numa_maps("7f0000000000 default file=/srv/x N٣=777 mapped=3 N0=2 kernelpagesize_kB=4\n")
    assert dict(res.pages) == {0: 2}
