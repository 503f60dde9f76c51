"""The effect bench's parts: the stand-in worker, the figures and the page built from them.

The stand-in is run for real (real named threads, real pipes); the figures and
the markdown are checked on fixed inputs whose answers are worked out by hand.
"""

from __future__ import annotations

import json
import os
import tempfile
from array import array
from pathlib import Path

import pytest

from bench import report
from bench.effect import (StandInProc, arm_result, latency_summary, log_histogram, migration_cut, percentile,
                          pin_all, ratios)
from tests.daemon_harness import wait_for
from tests.deploy_tools import missing
from tests.threadname import program


def _comm(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/comm") as fh:
        return fh.read().strip()


def test_stand_in_names_its_threads_and_reports_one_sample_per_step():
    w = StandInProc(helpers=2, work=50)
    try:
        assert _comm(w.pid, w.tids["acl"][0]) == "acl_thread"
        assert _comm(w.pid, w.tids["release"][0]) == "release_thread"
        assert _comm(w.pid, w.tids["main"][0]) == "stand_in_main"
        assert sorted(_comm(w.pid, t) for t in w.tids["helpers"]) == ["worker_h0", "worker_h1"]
        assert w.ask("warm 20") == "ok"
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "samples.bin")
            word, steps, wall = w.ask(f"run 0.2 {path}").split()
            samples = array("q")
            with open(path, "rb") as fh:
                samples.frombytes(fh.read())
        assert word == "done"
        assert int(steps) == len(samples) > 0
        # each sample is one step inside the run: positive, and no longer than the whole run
        assert 0 < min(samples) and max(samples) <= int(wall)
        assert sum(samples) <= int(wall)
    finally:
        w.close()
    assert w.proc.returncode is not None


def test_pool_only_arm_pins_every_thread_and_masks_read_back():
    cpu = min(os.sched_getaffinity(0))
    w = StandInProc(helpers=1, work=10)
    try:
        pin_all(w.pid, frozenset({cpu}))
        assert w.masks() == {role: str(cpu) for role in ("main", "acl", "release", "helpers")}
    finally:
        w.close()


def test_percentiles_are_nearest_rank():
    values = list(range(1, 1001))
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 99.9)) == (500, 990, 999)
    assert percentile([7], 99.9) == 7
    s = latency_summary([3000, 1000, 2000])  # ns in, us out
    assert (s["p50"], s["max"], s["mean"]) == (2.0, 3.0, 2.0)


def test_log_histogram_keeps_every_sample_and_puts_it_in_its_decade():
    h = log_histogram([500, 1500, 15_000, 15_000, 5e9], lo_ns=1e3, hi_ns=1e6, per_decade=1)
    assert h["edges_us"] == [1.0, 10.0, 100.0, 1000.0]
    # 500 ns clamps into the first bin, 5 s into the last
    assert h["counts"] == [2, 2, 1]


def _acc(samples_us, migrations, nonvol, wall_s=2.0):
    return {"samples": array("q", [int(x * 1000) for x in samples_us]), "wall_s": wall_s, "bind_ms": [],
            "migrations": dict(zip(("main", "acl", "release", "helpers"), migrations)),
            "nonvoluntary": dict(zip(("main", "acl", "release", "helpers"), nonvol)),
            "masks": {"acl": "1"}}


def fixed_results(idle_cpu: float) -> dict:
    arms = {
        "unbound": arm_result("unbound", _acc([10] * 98 + [100, 1000], (10, 20, 10, 8), (100, 400, 4, 8)), 2),
        "daemon": arm_result("daemon", _acc([20] * 98 + [50, 60], (0, 1, 0, 0), (50, 40, 2, 8)), 2),
        "pool": arm_result("pool", _acc([10] * 100, (10, 20, 10, 8), (100, 400, 4, 8)), 2),
    }
    return {
        "machine": {"nproc": 2, "cpu_model": "Test CPU", "arch": "x86_64", "kernel": "6.1", "python": "3.11",
                    "loadavg": [1.0, 1.0, 1.0], "date": "2025-01-01 00:00 UTC"},
        "effect": {"params": {"seconds": 4, "rounds": 2, "helpers": 2, "work": 100, "neighbour": "stress-ng --cpu 2",
                              "npu": 0, "fixture_host": True, "cpus": 2},
                   "plan": {"pool": [0, 1], "main": [0], "acl": [1], "release": [1]},
                   "arms": arms, "ratios": ratios(arms)},
        "daemon_idle": {"params": {"seconds": 30}, "rows": [
            {"workers": 16, "threads_per_worker": 200, "threads_total": 3200, "reconcile_seconds": 5.0,
             "window_s": 32.5, "cpu_percent": idle_cpu, "rss_mb": 34.0, "daemon_threads": 5, "passes": 6, "pass_ms": 40.0,
             "pass_us_per_thread": 12.5, "cpu_ms_per_pass": 20.0, "cpu_us_per_thread": 6.25}]},
    }


def test_ratios_and_migration_cut_from_fixed_arms():
    res = fixed_results(0.5)["effect"]
    # role threads: unbound 10+20+10 = 40 migrations, daemon 0+1+0 = 1, both over 2 s
    assert migration_cut(res["arms"]["daemon"], res["arms"]["unbound"]) == pytest.approx(1 - 1 / 40)
    assert res["ratios"]["daemon"]["p99"] == pytest.approx(50 / 100)      # p99 is the 99th of 100 samples
    assert res["ratios"]["daemon"]["p50"] == pytest.approx(20 / 10)
    assert res["ratios"]["pool"]["migration_cut"] == pytest.approx(0.0)
    assert res["arms"]["daemon"]["threads"]["acl"]["migrations_per_s"] == pytest.approx(0.5)


def test_page_and_headlines_carry_the_measured_figures():
    lines = report.headlines(fixed_results(0.5))
    assert "migrate 97.5 % less than unbound under the neighbour (goal >= 90 %: met)" in lines[0]
    assert "p99 step latency bound / unbound = 0.50x" in lines[1]
    assert "CPU 0.500 % of one CPU (goal < 0.2 %: MISSED)" in lines[2]
    assert "RSS 34.0 MB (goal < 60 MB: met)" in lines[2]
    assert "12.50 us per thread" in lines[3]
    assert "goal < 0.2 %: met" in report.headlines(fixed_results(0.1))[2]

    page = report.render_markdown(fixed_results(0.5))
    assert "| step latency p99 (us) | 100.0 | 50.0 | 10.0 | 0.50x | 0.10x |" in page
    assert "| 16 x 200 | 3200 | 5 | 32 | 0.500 | 34.0 | 6 | 40.00 | 12.50 | 20.00 | 6.25 |" in page
    assert "Test CPU" in page and "2025-01-01" in page
    for png in ("effect_latency", "effect_threads", "daemon_idle"):
        assert f"(bench/{png}.png)" in page
    assert "issue" not in page.lower()


def test_plots_are_written_small():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing("matplotlib (the bench extra: pip install -e '.[bench]')")
    with tempfile.TemporaryDirectory() as tmp:
        made = report.draw(fixed_results(0.5), Path(tmp))
        assert len(made) == 3
        for p in made:
            data = p.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
            assert 1000 < len(data) < report.PNG_LIMIT


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()[0]


def test_neighbour_paused_stops_every_burner_and_resumes_them():
    from bench.neighbour import Neighbour

    n = Neighbour("spin", 2, budget_s=120)
    n.start()
    procs = list(n.members)
    try:
        pids = [p.pid for p in procs]
        with n.paused():
            assert wait_for(lambda: all(_state(p) == "T" for p in pids), 10), [_state(p) for p in pids]
        assert wait_for(lambda: all(_state(p) in "RS" for p in pids), 10), [_state(p) for p in pids]
        n.check()  # still running: paused is not ended
    finally:
        n.stop()
    assert all(p.poll() is not None for p in procs)


def test_a_saved_run_is_reported_again_without_measuring(tmp_path, capsys):
    from bench import effect

    saved = dict(fixed_results(0.5)["effect"], bench="effect")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    assert effect.main(["--from-json", str(path), "--json", str(tmp_path / "again.json")]) == 0
    out = capsys.readouterr().out
    assert "p99 step latency bound / unbound = 0.50x" in out
    assert json.loads((tmp_path / "again.json").read_text())["arms"].keys() == saved["arms"].keys()


def test_make_bench_keeps_the_sections_written_by_hand_where_they_were():
    old = ("# Benchmarks\n\nold intro\n\n## What binding buys\n\nold figures\n\n"
           "## Memory placement on a two-node kernel\n\nby hand, kept\n\n## Daemon cost at scale\n\nold idle\n")
    page = report.render_markdown(fixed_results(0.5))
    out = report.keep_written_by_hand(page, old)
    assert "by hand, kept" in out and "old figures" not in out and "old idle" not in out and "old intro" not in out
    headings = [line for line in out.splitlines() if line.startswith("## ")]
    assert headings.index("## Memory placement on a two-node kernel") == 1  # where it was: after the first
    assert set(headings) == {line for line in page.splitlines() if line.startswith("## ")} | {
        "## Memory placement on a two-node kernel"}
    assert report.keep_written_by_hand(page, "") == page


# a stand-in for the emulator: a process named like QEMU with two threads named like its vCPUs,
# "CPU 0/TCG" spinning on one host CPU (the lowest it may use: CPU 0 on most machines) beside a
# second spinner there (so it waits on the run queue half the time), "CPU 1/TCG" asleep; it says
# "ready" once every thread is named and placed
_EMULATOR = program(r"""
import os, sys, threading
name_self(b"qemu-system-x86")
named = threading.Barrier(4)
never, _keep = os.pipe()  # a pipe of its own that nobody writes (sys.stdin has a lock a second reader waits on)
one_cpu = {min(os.sched_getaffinity(0))}
def thread(name, spin):
    name_self(name)
    if spin:
        os.sched_setaffinity(0, one_cpu)
    named.wait()
    while spin:
        pass
    os.read(never, 1)
threading.Thread(target=thread, args=(b"CPU 0/TCG", True), daemon=True).start()
threading.Thread(target=thread, args=(b"CPU 1/TCG", False), daemon=True).start()
threading.Thread(target=thread, args=(b"contender", True), daemon=True).start()
named.wait()
print("ready", flush=True)
sys.stdin.read()
""")


def test_the_emulators_vcpu_threads_are_found_by_name_and_their_waits_added_up_per_arm():
    import subprocess
    import sys

    from bench.effect_parts import MARK, VcpuDelay

    # the vng process's session: here, a session whose leader is the emulator itself
    proc = subprocess.Popen([sys.executable, "-c", _EMULATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        v = VcpuDelay(favour=frozenset({1, 7}))  # no vCPU 7 here: favoured where it exists
        v.on_line(proc, "some other line of the bench\n")
        assert v.threads == {}  # only a mark makes it look
        asleep = next(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if _comm(proc.pid, int(t)) == "CPU 1/TCG")

        def in_its_read(tid: int) -> bool:
            # asleep, and not on a futex (the GIL, the barrier): in the read of a pipe nobody writes
            with open(f"/proc/{proc.pid}/task/{tid}/stat") as fh:
                state = fh.read().rpartition(")")[2].split()[0]
            with open(f"/proc/{proc.pid}/task/{tid}/wchan") as fh:
                return state == "S" and not fh.read().startswith("futex")

        assert wait_for(lambda: in_its_read(asleep), 30, 0.01)  # from here on it never runs
        for tag in ("host-0", "host-1", "daemon-0"):
            v.on_line(proc, f"{MARK} {tag} start\n")
            # CPU 0's two spinners take turns: wait until "CPU 0/TCG" has waited since the start
            assert wait_for(lambda: v._waits()[0] > v.open[tag][1][0], 30, 0.01)
            v.on_line(proc, f"{MARK} {tag} end\n")
        v.on_line(proc, f"{MARK} never-0 end\n")  # an end without its start is not counted
        v.on_line(proc, f"{MARK} host-2 start later\n")  # nor a line that is not a mark
        assert v.qemu == proc.pid and set(v.threads) == {0, 1}
        for cpu, tid in v.threads.items():
            assert _comm(proc.pid, tid) == f"CPU {cpu}/TCG"
        assert os.getpriority(os.PRIO_PROCESS, v.threads[1]) == -10  # favoured at the first mark
        assert os.getpriority(os.PRIO_PROCESS, v.threads[0]) == 0
        out = v.result()
        assert set(out) == {"host", "daemon"} and out["host"]["wall_s"] > 0
        assert set(out["host"]["run_delay_ms_per_s"]) == {"0", "1"}
        # in ns, before the figures are rounded to ms a second: a wait of some ns would round to 0
        assert v.arms["host"]["wait_ns"][0] > 0 and v.arms["daemon"]["wait_ns"][0] > 0
        assert v.arms["host"]["wait_ns"][1] == 0  # asleep throughout: never on a run queue
    finally:
        proc.kill()
        proc.wait()


# a trace as the 6.1 kernel prints it: role threads 810 (main, CPU 1) and 812 (acl_thread, CPU 3)
_TRACE = """\
# tracer: nop
# entries-in-buffer/entries-written: 14/16   #P:8
          <idle>-0       [003] d..2.   100.000000: sched_wakeup: comm=acl_thread pid=812 prio=120 target_cpu=003
          <idle>-0       [003] ..s1.   100.000010: softirq_entry: vec=7 [action=SCHED]
          <idle>-0       [003] ..s1.   100.000050: softirq_exit: vec=7 [action=SCHED]
          <idle>-0       [003] d..2.   100.000100: sched_switch: prev_comm=swapper/3 prev_pid=0 prev_prio=120 \
prev_state=R ==> next_comm=acl_thread next_pid=812 next_prio=120
      acl_thread-812     [003] d..2.   100.000200: sched_switch: prev_comm=acl_thread prev_pid=812 prev_prio=120 \
prev_state=R ==> next_comm=ksoftirqd/3 next_pid=30 next_prio=120
     ksoftirqd/3-30      [003] ..s1.   100.000210: softirq_entry: vec=7 [action=SCHED]
     ksoftirqd/3-30      [003] ..s1.   100.000290: softirq_exit: vec=7 [action=SCHED]
     ksoftirqd/3-30      [003] d..2.   100.000300: sched_switch: prev_comm=ksoftirqd/3 prev_pid=30 prev_prio=120 \
prev_state=S ==> next_comm=acl_thread next_pid=812 next_prio=120
      acl_thread-812     [003] d..2.   100.000400: sched_switch: prev_comm=acl_thread prev_pid=812 prev_prio=120 \
prev_state=S ==> next_comm=swapper/3 next_pid=0 next_prio=120
      acl_thread-812     [003] d..3.   100.000390: sched_wakeup: comm=stand_in_main pid=810 prio=120 target_cpu=001
          <idle>-0       [001] d..2.   100.000590: sched_switch: prev_comm=swapper/1 prev_pid=0 prev_prio=120 \
prev_state=R ==> next_comm=stand_in_main next_pid=810 next_prio=120
   stand_in_main-810     [001] d..2.   100.001000: sched_switch: prev_comm=stand_in_main prev_pid=810 prev_prio=120 \
prev_state=R+ ==> next_comm=kworker/1:1 next_pid=44 next_prio=120
     kworker/1:1-44      [001] .....   100.001010: workqueue_execute_start: work struct 00000000c0ffee00: \
function vmstat_update
     kworker/1:1-44      [001] d..2.   100.001100: sched_switch: prev_comm=kworker/1:1 prev_pid=44 prev_prio=120 \
prev_state=I ==> next_comm=stand_in_main next_pid=810 next_prio=120
not a trace line at all
"""


def test_a_trace_says_who_preempted_the_role_threads_and_what_their_wake_ups_waited_for():
    from bench.effect_trace import attribute, merge

    lines = _TRACE.replace("\\\n", "").splitlines(keepends=True)
    out = attribute(lines, {810: "main", 812: "acl"})
    # acl_thread runnable, switched out for ksoftirqd; main (R+) for a kworker
    assert out["preempted_by"] == {"ksoftirqd": 1, "kworker": 1}
    assert out["ksoftirqd_ran"] == {"SCHED": 1}
    # acl woken at .000000, ran at .000100, 40 us of it in a softirq on CPU 3; main 200 us, none
    assert out["wakeups"]["acl"] == {"count": 1, "wait_s": 0.0001, "in_softirq_s": 0.00004}
    assert out["wakeups"]["main"] == {"count": 1, "wait_s": 0.0002, "in_softirq_s": 0.0}
    assert out["others"] == {"ksoftirqd": {"switched_in": 1, "ran_s": 0.0001},
                             "kworker": {"switched_in": 1, "ran_s": 0.0001}}
    assert out["work_items"] == {"vmstat_update": 1}
    assert out["events_lost"] == 2
    twice = merge(merge(None, out), out)
    assert twice["preempted_by"] == {"ksoftirqd": 2, "kworker": 2} and twice["wakeups"]["acl"]["count"] == 2
    assert twice["others"]["kworker"] == {"switched_in": 2, "ran_s": 0.0002}


@pytest.mark.parametrize("argv", [["--trace"], ["--favour-vcpus", "0-3"], ["--guest", "--favour-vcpus", "3-x"]])
def test_guest_only_options_are_refused_outside_the_guest_or_malformed(argv):
    from bench.effect import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--seconds", "1"])
    assert e.value.code == 2


def _streamed(script: str):
    import subprocess

    return subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_guests_stdout_reaches_the_watcher_line_by_line_and_the_caller_whole():
    from tests.numa_guest import _communicate

    seen = []
    proc = _streamed("echo a; echo b >&2; echo c")
    out, err = _communicate(proc, 60, lambda p, line: seen.append((p.pid, line)))
    assert (out, err) == ("a\nc\n", "b\n") and seen == [(proc.pid, "a\n"), (proc.pid, "c\n")]


def test_a_streamed_guest_past_its_timeout_is_killed_and_what_it_printed_is_kept():
    import subprocess

    from tests.numa_guest import _communicate

    seen = []
    proc = _streamed("echo a; echo b >&2; exec sleep 600")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        _communicate(proc, 5, lambda p, line: seen.append(line))
    assert proc.returncode == -9  # killed and reaped, not left running
    assert (e.value.output, e.value.stderr) == ("a\n", "b\n") and seen == ["a\n"]
