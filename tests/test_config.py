import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from ascendbind.values.config import Config
from ascendbind.settings import OTHER_VARIABLES, load_config
from ascendbind.errors import ConfigError
from tests.daemon_harness import PATIENCE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_reproduce_the_seed(tmp_path):
    cfg = load_config(None, env={})
    assert cfg.small_pool == "fail"
    assert cfg.irq_binding is True
    assert cfg.topology_policy == "none"
    assert cfg.numa_extension == "next"
    assert cfg.explicit == frozenset()


def test_file_env_flag_precedence(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('small_pool = "share"\nreconcile_seconds = 2\ntopology_policy = "restricted"\n')
    cfg = load_config(str(path), env={"ASCENDBIND_RECONCILE_SECONDS": "1"}, overrides={"topology_policy": "none"})
    assert cfg.small_pool == "share"
    assert cfg.reconcile_seconds == 1.0
    assert cfg.topology_policy == "none"
    assert {"small_pool", "reconcile_seconds", "topology_policy"} <= cfg.explicit


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("smal_pool = 'share'\n")
    with pytest.raises(ConfigError, match="smal_pool"):
        load_config(str(path), env={})


@pytest.mark.parametrize(
    "env",
    [
        {"ASCENDBIND_SMALL_POOL": "maybe"},
        {"ASCENDBIND_IRQ_BINDING": "perhaps"},
        {"ASCENDBIND_MAX_NUMA_NODES": "0"},
        {"ASCENDBIND_RECONCILE_SECONDS": "-1"},
        {"ASCENDBIND_MEMORY_CHECK_SECONDS": "-60"},
        {"ASCENDBIND_MEMORY_RERUN_SECONDS": "later"},
    ],
)
def test_bad_env_values_are_named(env):
    with pytest.raises(ConfigError, match=next(iter(env))):
        load_config(None, env=env)


@pytest.mark.parametrize(
    ("text", "says"),
    [("1.5", "is a share, from 0 to 1; got 1.5"), ("-0.1", "expected a non-negative number"),
     ("80%", "expected a number")],
)
def test_the_locality_threshold_is_a_share(text, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, env={"ASCENDBIND_MEMORY_LOCAL_THRESHOLD": text})
    assert "ASCENDBIND_MEMORY_LOCAL_THRESHOLD: key 'memory_local_threshold'" in str(err.value) and says in str(err.value)
    for ok in ("0", "0.95", "1"):
        assert load_config(None, env={"ASCENDBIND_MEMORY_LOCAL_THRESHOLD": ok}).memory_local_threshold == float(ok)


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"), env={})


@pytest.mark.parametrize("value,bad", [(8.7, "8.7"), ("eight", "'eight'"), (8.0, "8.0"), (True, "True")])
def test_an_integer_key_takes_whole_numbers_only(tmp_path, value, bad):
    path = tmp_path / "c.toml"
    path.write_text(f"max_numa_nodes = {json.dumps(value)}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), env={})
    assert str(err.value) == f"config file {path}: key 'max_numa_nodes': expected a whole number, got {bad}"


@pytest.mark.parametrize("text,want", [("8", 8), (" 12 ", 12), ("+3", 3)])
def test_an_integer_from_the_environment_is_parsed_exactly(text, want):
    assert load_config(None, env={"ASCENDBIND_MAX_NUMA_NODES": text}).max_numa_nodes == want


@pytest.mark.parametrize("text", ["8.7", "eight", "8e0", "0x8", ""])
def test_an_integer_from_the_environment_that_is_not_one_is_named(text):
    with pytest.raises(ConfigError, match=r"ASCENDBIND_MAX_NUMA_NODES: key 'max_numa_nodes': expected a whole number"):
        load_config(None, env={"ASCENDBIND_MAX_NUMA_NODES": text})


@pytest.mark.parametrize("text", ["soon", "nan", "inf", "-inf"])
def test_a_number_key_takes_finite_numbers_only(text):
    with pytest.raises(ConfigError, match=r"key 'command_timeout_seconds': expected a (finite )?number"):
        load_config(None, env={"ASCENDBIND_COMMAND_TIMEOUT_SECONDS": text})
    assert load_config(None, env={"ASCENDBIND_COMMAND_TIMEOUT_SECONDS": "2.5"}).command_timeout_seconds == 2.5


def test_an_unknown_ascendbind_variable_is_an_error_naming_it():
    with pytest.raises(ConfigError) as err:
        load_config(None, env={"ASCENDBIND_TOPOLGY": "restricted"})
    assert "'ASCENDBIND_TOPOLGY'" in str(err.value) and "'ASCENDBIND_TOPOLOGY_POLICY'" in str(err.value)
    with pytest.raises(ConfigError, match="ASCENDBIND_small_pool"):
        load_config(None, env={"ASCENDBIND_small_pool": "share"})  # keys are upper case
    with pytest.raises(ConfigError, match="ASCENDBIND_EXPLICIT"):
        load_config(None, env={"ASCENDBIND_EXPLICIT": "x"})  # an internal field, not a key
    # variables that are not keys but are ours, and other programs' variables, pass
    cfg = load_config(None, env={**{name: "x" for name in OTHER_VARIABLES if name != "ASCENDBIND_CONFIG"},
                                 "ASCENDBIND_CONFIG": "", "ASCEND_RT_VISIBLE_DEVICES": "0", "ASCENDBINDX": "1"})
    assert cfg == load_config(None, env={"ASCENDBIND_CONFIG": ""})


def test_every_ascendbind_variable_the_project_uses_is_a_key_or_listed():
    # a variable set or read anywhere in the tree must be a config key or listed in
    # OTHER_VARIABLES, or a daemon started with it would refuse to start
    keys = {"ASCENDBIND_" + f.name.upper() for f in dataclasses.fields(Config) if f.name != "explicit"}
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "Makefile")]
    for top in ("ascendbind", "tests", "fixtures", "bench", "systemd", "docs"):
        paths += [os.path.join(d, name) for d, _, names in os.walk(os.path.join(ROOT, top)) for name in names]
    used: set[str] = set()
    for path in paths:
        if os.path.samefile(path, __file__):
            continue  # this file misspells on purpose
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError):
            continue
        used.update(re.findall(r"\bASCENDBIND_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text))
    assert used and used - keys - set(OTHER_VARIABLES) == set()


# ---------------------------------------------------------------- the same through the real CLI


def cli(*argv, env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDBIND_")}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "ascendbind", *argv], capture_output=True, text=True, env=e,
                          cwd=ROOT, timeout=60 * PATIENCE)


def one_line(r, status: int) -> str:
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "toml,env,says",
    [
        ("max_numa_nodes = 8.7\n", {}, "key 'max_numa_nodes': expected a whole number, got 8.7"),
        ('max_numa_nodes = "eight"\n', {}, "key 'max_numa_nodes': expected a whole number, got 'eight'"),
        ("", {"ASCENDBIND_MAX_NUMA_NODES": "8.7"}, "ASCENDBIND_MAX_NUMA_NODES: key 'max_numa_nodes'"),
        ("", {"ASCENDBIND_TOPOLGY": "restricted"}, "unknown variable 'ASCENDBIND_TOPOLGY'"),
        ("topolgy_policy = 'restricted'\n", {}, "unknown key 'topolgy_policy' (did you mean 'topology_policy'?)"),
    ],
)
@pytest.mark.parametrize("verb", ["plan", "serve"])
def test_bad_config_is_one_line_exit_2_before_anything_runs(tmp_path, toml, env, says, verb):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    argv = ["plan", "--snapshot", os.path.join(ROOT, "fixtures", "hosts", "a3-16die"), "--npu", "0"]
    if verb == "serve":
        # would listen here if the config were good; it must refuse first
        env = {**env, "ASCENDBIND_SOCKET": str(tmp_path / "s.sock"), "ASCENDBIND_STATE_DIR": str(tmp_path / "st"),
               "ASCENDBIND_METRICS_LISTEN": ""}
        argv = ["serve"]
    line = one_line(cli(*argv, "--config", str(cfg), env=env), 2)
    assert says in line
    assert not (tmp_path / "s.sock").exists()
