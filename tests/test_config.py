import pytest

from ascendbind.config import load_config
from ascendbind.errors import ConfigError


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
    ],
)
def test_bad_env_values_are_named(env):
    with pytest.raises(ConfigError, match=next(iter(env))):
        load_config(None, env=env)


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"), env={})
