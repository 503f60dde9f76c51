"""irqbalance's control protocol without irqbalance: the ``setup`` parser, the ban
command and merge rules (pure), the bans' JSON and ownership rules, and the
socket client against stand-in listeners that misbehave (silent, garbage, too
much, the wrong peer). tests/test_irqbalance.py runs the real one."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ascendbind.applier.irqbalance import MAX_REPLY, IrqbalanceLink, Unreachable, ban_irqs, hand_back
from ascendbind.daemon.state.staterecord import binding_from_json, binding_to_json
from ascendbind.values.frozen import frozen_map
from ascendbind.settings import load_config
from ascendbind.daemon.heart.step import inherit
from ascendbind.daemon.watch.bans import carried_bans, split_bans
from ascendbind.discovery.parse.irqbalance import (
    MAX_COMMAND,
    BanListTooLong,
    ban_command,
    list_with,
    list_without,
    parse_setup,
)
from ascendbind.errors import ConfigError, ParseError
from ascendbind.values.model import Binding, DeviceType, IrqbalanceBans, Mode, NpuPlan, Plan
from tests.daemon_harness import wait_for
from tests.irqbalance_harness import abstract_address_lock, fixture_proc_link

# ---------------------------------------------------------------- setup reply


def test_setup_reply_with_bans_as_irqbalance_1_9_prints_it():
    s = parse_setup("SLEEP 1 IRQ 9001 LOAD 0 DIFF 0 CLASS 0 IRQ 9002 LOAD 17 DIFF 3 CLASS 4 BANNED 00000000")
    assert (s.sleep_seconds, s.banned_irqs, s.banned_cpus) == (1, frozenset({9001, 9002}), "00000000")


def test_setup_reply_without_bans_and_a_wide_cpu_mask():
    s = parse_setup("SLEEP 10 BANNED 00000000,00000003")
    assert s.banned_irqs == frozenset() and s.banned_cpus == "00000000,00000003"


@pytest.mark.parametrize("text", [
    "",
    "SLEEP ten BANNED 0",
    "SLEEP 1 IRQ 5 LOAD 0 DIFF 0 BANNED 0",  # CLASS missing
    "SLEEP 1 IRQ 5 LOAD 0 DIFF 0 CLASS 0",  # cut before BANNED
    "SLEEP 1 IRQ -5 LOAD 0 DIFF 0 CLASS 0 BANNED 0",
    "SLEEP 1 BANNED zz",
    "SLEEP 1 BANNED 0 IRQ 7",
    "TYPE 3 NUMBER -1 LOAD 0 SAVE_MODE 0",  # the stats reply
    "HTTP/1.1 200 OK",
])
def test_anything_but_a_setup_reply_is_a_parse_error_naming_the_source(text):
    with pytest.raises(ParseError, match="irqbalance setup reply"):
        parse_setup(text)


# ---------------------------------------------------------------- ban command, merge


def test_ban_command_is_sorted_once_each_and_none_when_empty():
    assert ban_command([423, 421, 423]) == "settings ban irqs 421 423"
    assert ban_command([]) == "settings ban irqs NONE"


def test_irq_0_can_only_be_first_and_is():
    # irqbalance reads numbers with strtoul until one reads 0
    assert ban_command([5, 0]) == "settings ban irqs 0 5"


def test_ban_command_longer_than_irqbalances_buffer_is_refused():
    fits = list(range(10000, 10000 + (MAX_COMMAND - len("settings ban irqs ") + 1) // 6))
    assert len(ban_command(fits)) <= MAX_COMMAND
    with pytest.raises(BanListTooLong, match="500"):
        ban_command(fits + [99999])
    with pytest.raises(ValueError):
        ban_command([-1])


def test_merge_keeps_every_ban_and_counts_only_new_ones_as_ours():
    whole, ours = list_with(frozenset({7, 421}), {421, 423})
    assert whole == {7, 421, 423} and ours == {423}
    assert list_without(frozenset({7, 421, 423, 500}), ours) == {7, 421, 500}


# ---------------------------------------------------------------- bans: JSON, ownership


def _binding(bans: IrqbalanceBans | None) -> Binding:
    plan = Plan(Mode.TOPO_AFFINITY, DeviceType.A2, None, (0, 1), (NpuPlan(0, (0, 1), (0,), (1,), (1,), (1,), (0,)),))
    return Binding(4242, 99, (0,), plan, frozenset({0, 1}), frozen_map({421: "3"}), (), bans)


def test_bans_survive_the_state_file_and_old_entries_load_without_them():
    bans = IrqbalanceBans(812, 2345, frozenset({421, 423}))
    raw = binding_to_json(_binding(bans))
    assert raw["irqbalance_bans"] == {"pid": 812, "start_time": 2345, "irqs": [421, 423]}
    assert binding_from_json(raw).irqbalance_bans == bans
    old = binding_to_json(_binding(None))
    assert "irqbalance_bans" not in old and binding_from_json(old).irqbalance_bans is None


@pytest.mark.parametrize("bad", [
    {"pid": 0, "start_time": 1, "irqs": [1]},
    {"pid": True, "start_time": 1, "irqs": [1]},
    {"pid": 5, "start_time": "1", "irqs": [1]},
    {"pid": 5, "start_time": 1, "irqs": [-1]},
    {"pid": 5, "start_time": 1, "irqs": ["421"]},
    {"start_time": 1, "irqs": [1]},
])
def test_malformed_bans_in_a_state_entry_are_refused(bad):
    raw = binding_to_json(_binding(None))
    raw["irqbalance_bans"] = bad
    with pytest.raises((ValueError, TypeError, KeyError)):
        binding_from_json(raw)


def test_a_new_owner_carries_older_holders_bans_on_the_same_irqbalance_only():
    mine = IrqbalanceBans(812, 2345, frozenset({423}))
    older = IrqbalanceBans(812, 2345, frozenset({421, 430}))
    restarted = IrqbalanceBans(812, 9999, frozenset({500}))
    assert carried_bans(mine, [older, None, restarted]).irqs == {421, 423, 430}
    assert carried_bans(None, [older]) == older
    assert carried_bans(None, [None]) is None


def test_a_departing_workers_bans_pass_to_live_workers_that_pin_those_irqs():
    bans = IrqbalanceBans(812, 2345, frozenset({421, 423, 430}))
    left, passed = split_bans(bans, {200: {421, 422}, 300: {421, 430}, 400: set()})
    assert left.irqs == {423}
    assert passed == {200: IrqbalanceBans(812, 2345, frozenset({421})),
                      300: IrqbalanceBans(812, 2345, frozenset({430}))}
    assert split_bans(bans, {200: {421, 423, 430}}) == (None, {200: bans})


def test_a_rebound_or_replacing_binding_inherits_the_older_holders_bans():
    # the new bind found 421/423 banned already (by the holder it replaces) and added none
    older = _binding(IrqbalanceBans(812, 2345, frozenset({421, 423})))
    newer = dataclasses.replace(_binding(None), pid=4343)
    assert inherit(newer, [older]).irqbalance_bans == older.irqbalance_bans


def test_ban_is_the_default_and_warn_stop_stay_choosable():
    assert load_config(None, env={}).irqbalance == "ban"
    assert load_config(None, env={"ASCENDBIND_IRQBALANCE": "warn"}).irqbalance == "warn"
    assert load_config(None, env={"ASCENDBIND_IRQBALANCE": "stop"}).irqbalance == "stop"
    with pytest.raises(ConfigError, match="ban, warn, stop"):
        load_config(None, env={"ASCENDBIND_IRQBALANCE": "auto"})


# ---------------------------------------------------------------- the client, stand-in peers


START = 5000


class StandIn:
    """A listener at ``<proc>/<pid>/root/run/irqbalance/irqbalance<pid>.sock`` of a
    fixture proc tree, run by this test process (so its SO_PEERCRED is ours)."""

    def __init__(self, tmp_path, pid: int, answer) -> None:
        self.proc = tmp_path / "proc"
        run = self.proc / str(pid) / "root" / "run" / "irqbalance"
        run.mkdir(parents=True)
        (self.proc / str(pid) / "stat").write_text(f"{pid} (irqbalance) S " + " ".join(["0"] * 18) + f" {START} 0 0\n")
        dfd = os.open(run, os.O_PATH)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(f"/proc/self/fd/{dfd}/irqbalance{pid}.sock")
        finally:
            os.close(dfd)
        self.sock.listen(4)
        self.answer = answer
        self.received: list[bytes] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(30)
            try:
                self.received.append(conn.recv(1000))
                self.answer(conn)
            except OSError:
                pass
            finally:
                self.done.wait(30)  # hold the connection open until the test is done

    def close(self) -> None:
        self.done.set()
        self.sock.close()
        self.thread.join(30)


@pytest.fixture
def stand_in(tmp_path):
    made = []

    def make(answer, pid=None):
        s = StandIn(tmp_path, os.getpid() if pid is None else pid, answer)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _close(conn):
    conn.shutdown(socket.SHUT_RDWR)


def test_a_silent_irqbalance_costs_one_timeout(stand_in):
    s = stand_in(lambda conn: None)  # reads the command, never answers, never closes
    t0 = time.monotonic()
    with pytest.raises(Unreachable, match="did not answer in time"):
        IrqbalanceLink(os.getpid(), 0.5, proc_root=str(s.proc)).setup()
    assert time.monotonic() - t0 < 10  # bounded by the deadline, not by the peer
    assert s.received == [b"setup"]


def test_a_reply_that_is_not_setups_format_is_unreachable_with_the_parse_error(stand_in):
    s = stand_in(lambda conn: (conn.sendall(b"\x00\xffgarbage"), _close(conn)))
    res = ban_irqs(os.getpid(), {421}, proc_root=str(s.proc), timeout=10)
    assert res.status == "unreachable" and "irqbalance setup reply" in res.sentence and res.bans is None


def test_a_peer_that_closes_without_a_word_is_named_as_such(stand_in):
    s = stand_in(_close)
    with pytest.raises(Unreachable, match="closed without a reply"):
        IrqbalanceLink(os.getpid(), 10, proc_root=str(s.proc)).setup()


def test_a_reply_beyond_the_bound_is_cut_off(stand_in):
    def flood(conn):
        chunk = b"IRQ 1 LOAD 0 DIFF 0 CLASS 0 " * 4096
        sent = 0
        while sent <= MAX_REPLY:
            conn.sendall(chunk)
            sent += len(chunk)
    s = stand_in(flood)
    with pytest.raises(Unreachable, match=f"more than {MAX_REPLY} bytes"):
        IrqbalanceLink(os.getpid(), 30, proc_root=str(s.proc)).setup()


def test_a_socket_held_by_another_pid_gets_nothing(stand_in, tmp_path):
    # the fixture says irqbalance is pid 1; our own process holds its socket
    s = stand_in(lambda conn: (conn.sendall(b"SLEEP 10 BANNED 0"), _close(conn)), pid=1)
    res = ban_irqs(1, {421}, proc_root=str(s.proc), timeout=5)
    assert res.status == "unreachable" and f"held by pid {os.getpid()}" in res.sentence
    assert b"".join(s.received) == b""  # refused before a word was sent


SQUATTER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(b"\\0" * 108)
s.listen(4)
print("listening", flush=True)
conn, _ = s.accept()
conn.settimeout(30)
print("got", conn.recv(1000), flush=True)
"""


def test_an_unprivileged_squatter_on_the_abstract_address_gets_nothing(tmp_path, nobody_prefix):
    # irqbalance falls back to one abstract address anyone may bind first; the
    # real-irqbalance abstract test takes the same lock
    with abstract_address_lock():
        squatter = subprocess.Popen([*nobody_prefix, sys.executable, "-c", SQUATTER], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        try:
            line = squatter.stdout.readline()
            if line != "listening\n":
                pytest.skip(f"the abstract address is taken: {squatter.stderr.read()[-200:]}")
            proc = tmp_path / "proc"
            proc.mkdir()
            fixture_proc_link(proc, squatter.pid)  # its own pid: only the uid check can refuse it
            res = ban_irqs(squatter.pid, {421}, proc_root=str(proc), timeout=5)
            assert res.status == "unreachable" and "(uid 65534)" in res.sentence
            assert wait_for(lambda: squatter.poll() is not None, 30)
            assert squatter.stdout.read() == "got b''\n"  # the connection closed with nothing sent
        finally:
            squatter.kill()
            squatter.wait()


def test_hand_back_to_another_irqbalance_process_sends_nothing(stand_in):
    s = stand_in(lambda conn: (conn.sendall(b"SLEEP 10 BANNED 0"), _close(conn)))
    # same pid, another start time: a restarted irqbalance, whose list is not ours
    status, sentence = hand_back(IrqbalanceBans(os.getpid(), START + 1, frozenset({421})),
                                 proc_root=str(s.proc), timeout=5)
    assert status == "gone" and "went with it" in sentence and s.received == []
    # the same process: it is asked (and this stand-in has nothing of ours banned)
    status, sentence = hand_back(IrqbalanceBans(os.getpid(), START, frozenset({421})),
                                 proc_root=str(s.proc), timeout=5)
    assert status == "handed back" and s.received == [b"setup"]
