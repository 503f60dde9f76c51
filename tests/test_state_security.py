"""The state directory under attack. Root writes ``state_dir`` after every bind;
another user who can add names there could aim root's writes at any file. The
attacks run for real: uid 65534 plants symlinks with setpriv, a real daemon
starts (or refuses to), and the victim file is read back byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from ascendbind.daemon.state.state import StateFile
from ascendbind.daemon.state.statedir import trusted_state_dir
from ascendbind.daemon.state.staterecord import binding_to_json
from ascendbind.errors import ConfigError
from tests.daemon_harness import DaemonProc, base_env, free_port, running_daemon, wait_for
from tests.test_daemon_parts import BINDING
from tests.workers import start_worker

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
VICTIM_TEXT = b"root's precious file\n"


@pytest.fixture
def world():
    """A directory uid 65534 can traverse, holding a root-owned victim file."""
    directory = tempfile.mkdtemp(prefix="ascendbind-state-", dir="/tmp")
    os.chmod(directory, 0o755)
    victim = os.path.join(directory, "victim")
    with open(victim, "wb") as fh:
        fh.write(VICTIM_TEXT)
    os.chmod(victim, 0o644)
    try:
        yield directory, victim
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def untouched(victim: str, before: os.stat_result) -> bool:
    with open(victim, "rb") as fh:
        data = fh.read()
    after = os.lstat(victim)
    return data == VICTIM_TEXT and (after.st_mtime_ns, after.st_ino, after.st_mode) == (
        before.st_mtime_ns, before.st_ino, before.st_mode)


def as_nobody(*argv: str) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not installed")
    subprocess.run([*NOBODY, *argv], check=True, timeout=30)


def daemon_in(directory: str, state_dir: str) -> DaemonProc:
    env = base_env(os.path.join(directory, "ascendbind.sock"), state_dir, free_port())
    return DaemonProc(directory, env)


# ---------------------------------------------------------------- which directories are trusted


def test_missing_state_dir_is_created_root_owned_0700(tmp_path):
    real = trusted_state_dir(str(tmp_path / "a" / "b" / "state"))
    st = os.lstat(real)
    assert real == str(tmp_path / "a" / "b" / "state")
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700


@pytest.mark.parametrize(
    ("setup", "why"),
    [
        (lambda d: os.chmod(d, 0o777), "writable by group or others (mode 777)"),
        (lambda d: os.chmod(d, 0o1777), "writable by group or others (mode 1777)"),
        (lambda d: os.chown(d, 65534, 65534), "is owned by uid 65534"),
        # the state dir is fine, but its parent lets others rename it away
        (lambda d: os.chmod(os.path.dirname(d), 0o777), "writable by group or others (mode 777)"),
    ],
)
def test_a_directory_another_user_could_change_is_refused(tmp_path, setup, why):
    state = tmp_path / "parent" / "state"
    state.mkdir(parents=True, mode=0o700)
    setup(str(state))
    with pytest.raises(ConfigError, match="not safe for root's state") as exc:
        trusted_state_dir(str(state))
    assert why in str(exc.value) and exc.value.code == "state_dir_untrusted" and exc.value.exit_status == 2


def test_a_sticky_world_writable_parent_is_fine_but_a_link_planted_in_it_is_not(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp
    assert trusted_state_dir(str(sticky / "state")) == str(sticky / "state")

    # another user's symlink in the sticky dir, aimed at a root-only directory
    target = tmp_path / "root-only"
    target.mkdir(mode=0o700)
    link = sticky / "planted"
    os.symlink(target, link)
    os.lchown(link, 65534, 65534)
    with pytest.raises(ConfigError, match="planted is a symlink owned by uid 65534"):
        trusted_state_dir(str(link))
    # root's own link is followed, and the directories it leads through are checked
    os.lchown(link, 0, 0)
    assert trusted_state_dir(str(link)) == str(target)
    os.chmod(tmp_path, 0o777)
    try:
        with pytest.raises(ConfigError, match="writable by group or others"):
            trusted_state_dir(str(link))
    finally:
        os.chmod(tmp_path, 0o700)


# ---------------------------------------------------------------- the file operations


def test_save_never_follows_a_planted_temp_name_and_start_up_removes_them(tmp_path, world):
    _, victim = world
    before = os.lstat(victim)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    # leftovers a crash (or the old predictable name) could leave: links, a file, a directory
    os.symlink(victim, state / f"state.json.tmp-{os.getpid()}")
    os.symlink(victim, state / "state.json.tmp-1")
    (state / "state.json.tmp-2").write_text("half a state")
    (state / "state.json.tmp-3").mkdir()
    planted = sorted(os.listdir(state))
    sf = StateFile(str(state))
    sf.save([binding_to_json(BINDING)])  # the old code wrote through state.json.tmp-<pid> here
    assert untouched(victim, before)
    st = os.lstat(sf.path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert sorted(sf.clean()["removed"]) == planted
    assert os.listdir(state) == ["state.json"]
    assert untouched(victim, before)
    assert len(sf.load().workers) == 1


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_state_json_that_is_no_regular_file_is_moved_aside(tmp_path, world, kind):
    _, victim = world
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    path = state / "state.json"
    {"directory": lambda: path.mkdir(), "fifo": lambda: os.mkfifo(path),
     "symlink": lambda: os.symlink(victim, path)}[kind]()
    sf = StateFile(str(state))
    moved = sf.clean()["moved_aside"]
    assert moved and os.path.basename(moved).startswith("state.json.corrupt-")
    assert not os.path.lexists(path)
    sf.save([])
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert open(victim, "rb").read() == VICTIM_TEXT


def test_a_save_swaps_a_whole_new_file_in_and_leaves_only_state_json(tmp_path):
    sf = StateFile(str(tmp_path / "state"))
    sf.prepare()
    sf.save([binding_to_json(BINDING)])  # no state.json yet: a plain rename puts the first one in
    with open(sf.path, "rb") as reader:
        first = reader.read()
        first_inode = os.fstat(reader.fileno()).st_ino
        sf.save([binding_to_json(BINDING), binding_to_json(BINDING)])
        reader.seek(0)
        # the reader's file was never written again: a new file took the name, whole
        assert reader.read() == first
    st = os.lstat(sf.path)
    assert st.st_ino != first_inode and stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    # the previous file went with its temp name: nothing is left to clean up
    assert os.listdir(sf.dir) == ["state.json"]
    assert len(sf.load().workers) == 2 and len(json.loads(first)["workers"]) == 1


def test_load_does_not_hang_on_a_fifo_it_was_not_told_about(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.mkfifo(state / "state.json")
    result = StateFile(str(state)).load()  # would block in open() without O_NONBLOCK
    assert result.workers == [] and "not a regular file (a fifo)" in result.problem


def test_a_directory_opened_up_after_start_is_not_written(tmp_path):
    sf = StateFile(str(tmp_path / "state"))
    sf.prepare()
    os.chmod(sf.dir, 0o777)
    with pytest.raises(ConfigError, match="no longer safe"):
        sf.save([])
    assert os.listdir(sf.dir) == []


# ---------------------------------------------------------------- the attack, for real


@pytest.mark.parametrize("how", ["mode 777", "owned by the attacker"])
def test_symlink_attack_on_an_untrusted_state_dir_makes_the_daemon_refuse_to_start(world, how):
    directory, victim = world
    before = os.lstat(victim)
    state = os.path.join(directory, "state")
    os.mkdir(state)
    if how == "mode 777":
        os.chmod(state, 0o777)
    else:
        os.chown(state, 65534, 65534)
    d = daemon_in(directory, state)
    d.start(wait=False)
    try:
        # the attacker aims the daemon's temp file (its pid is public) and state.json at the victim
        for name in (f"state.json.tmp-{d.pid}", "state.json"):
            as_nobody("ln", "-sf", victim, os.path.join(state, name))
        assert d.proc.wait(timeout=30) == 2, d.log()
        lines = [line for line in d.log().splitlines() if line.strip()]
        assert lines[-1].startswith(f"ascendbind: state_dir {state} is not safe for root's state"), d.log()
        assert "Traceback" not in d.log()
        assert not os.path.exists(os.path.join(directory, "ascendbind.sock"))
    finally:
        d.stop()
    assert untouched(victim, before)


def test_leftover_temp_links_in_a_trusted_dir_are_removed_and_binds_write_only_state_json(world):
    directory, victim = world
    before = os.lstat(victim)
    state = os.path.join(directory, "state")
    os.mkdir(state, 0o700)
    for n in range(1, 4):
        os.symlink(victim, os.path.join(state, f"state.json.tmp-{n}"))
    with open(os.path.join(state, "state.json.tmp-99"), "w") as fh:
        fh.write("{")
    with running_daemon(directory) as d, start_worker(plain=1) as w:
        assert d.state_dir == state
        assert os.listdir(state) == ["state.json"]  # written at start, leftovers gone
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, body
        assert os.listdir(state) == ["state.json"]
        st = os.lstat(os.path.join(state, "state.json"))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        assert [w["pid"] for w in json.load(open(os.path.join(state, "state.json")))["workers"]] == [w.pid]
        assert "removed stale state temp files" in d.log()
    assert untouched(victim, before)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_daemon_starts_when_state_json_is_a_directory_or_fifo(world, kind):
    directory, _ = world
    state = os.path.join(directory, "state")
    os.mkdir(state, 0o700)
    path = os.path.join(state, "state.json")
    os.mkdir(path) if kind == "directory" else os.mkfifo(path)
    with running_daemon(directory) as d, start_worker(plain=1) as w:
        assert d.client.health()["status"] in ("ok", "degraded")
        aside = [n for n in os.listdir(state) if n.startswith("state.json.corrupt-")]
        assert len(aside) == 1, os.listdir(state)
        mode = os.lstat(os.path.join(state, aside[0])).st_mode
        assert (stat.S_ISDIR if kind == "directory" else stat.S_ISFIFO)(mode)
        assert d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})[0] == 200
        assert wait_for(lambda: stat.S_ISREG(os.lstat(path).st_mode), 5)
