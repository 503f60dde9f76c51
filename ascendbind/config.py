"""Configuration: TOML file < ``ASCENDBIND_<KEY>`` environment < CLI flags (SPEC §8).

Every key is optional. An unknown key in the file or a bad value anywhere is a
ConfigError naming the key and where it came from, raised at start-up.
``load_config`` is the one entry point; ``Config`` is frozen so a reload
(SIGHUP) produces a new object rather than mutating a shared one.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["Config", "load_config", "DEFAULT_CONFIG_PATH", "CHOICES", "PLAN_KEYS"]

DEFAULT_CONFIG_PATH = "/etc/ascendbind/config.toml"

CHOICES: dict[str, tuple[str, ...]] = {
    "device_type": ("auto", "A2", "A3", "310P", "950", "unknown"),
    "small_pool": ("fail", "share"),
    "irqbalance": ("warn", "stop"),
    "topology_policy": ("none", "best-effort", "restricted", "single-numa-node"),
    "numa_extension": ("next", "closest", "none"),
    "cpu_bind_policy": ("default", "full-pcpus"),
}

# keys that shape a plan: each has a flag on plan/apply/serve (SPEC §3)
PLAN_KEYS = (
    "device_type",
    "small_pool",
    "irq_binding",
    "topology_policy",
    "prefer_closest_numa",
    "max_numa_nodes",
    "numa_extension",
    "cpu_bind_policy",
)


@dataclass(frozen=True)
class Config:
    socket: str = "/run/ascendbind/ascendbind.sock"
    state_dir: str = "/var/lib/ascendbind"
    metrics_listen: str = "127.0.0.1:9464"
    reconcile_seconds: float = 5.0
    device_type: str = "auto"
    small_pool: str = "fail"
    irqbalance: str = "warn"
    irq_binding: bool = True
    topology_policy: str = "none"
    prefer_closest_numa: bool = False
    max_numa_nodes: int = 8
    numa_extension: str = "next"
    cpu_bind_policy: str = "default"
    socket_group: str = ""
    allow_shared_npu: bool = False
    auto_bind: bool = False
    auto_bind_seconds: float = 30.0
    npu_smi: str = "npu-smi"
    command_timeout_seconds: float = 10.0
    proc_root: str = "/proc"
    sys_root: str = "/sys"
    # which keys were set explicitly (file, env or flag) rather than defaulted;
    # the policy precedence rule needs to know whether the node named a policy
    explicit: frozenset[str] = frozenset()

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in dataclasses.fields(Config) if f.name != "explicit"}


def _coerce(key: str, value: Any, where: str) -> Any:
    kind = type(_FIELDS[key].default)
    try:
        if kind is bool:
            if isinstance(value, bool):
                out: Any = value
            elif isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
                out = True
            elif isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError(f"expected true or false, got {value!r}")
        elif kind is int:
            if isinstance(value, bool):
                raise ValueError(f"expected an integer, got {value!r}")
            out = int(value)
        elif kind is float:
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            out = float(value)
            if out < 0:
                raise ValueError(f"expected a non-negative number, got {value!r}")
        else:
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            out = value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: key {key!r}: {exc}") from None
    choices = CHOICES.get(key)
    if choices and out not in choices:
        raise ConfigError(f"{where}: key {key!r} must be one of {', '.join(choices)}; got {out!r}")
    if key == "max_numa_nodes" and out < 1:
        raise ConfigError(f"{where}: key 'max_numa_nodes' must be at least 1; got {out}")
    if key == "metrics_listen" and out and out.rpartition(":")[1] != ":":
        raise ConfigError(f"{where}: key 'metrics_listen' must be host:port (or empty to disable); got {out!r}")
    return out


def load_config(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build a Config from file, environment and flag overrides (None values ignored).

    ``path`` None means the default path if it exists; an explicit path that is
    missing is an error.
    """
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    env = os.environ if env is None else env

    file_path = path if path is not None else env.get("ASCENDBIND_CONFIG")
    if file_path is None and os.path.exists(DEFAULT_CONFIG_PATH):
        file_path = DEFAULT_CONFIG_PATH
    if file_path:
        try:
            with open(file_path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {file_path} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {file_path}: {exc}") from None
        for key, value in data.items():
            if key not in _FIELDS:
                raise ConfigError(f"config file {file_path}: unknown key {key!r}")
            values[key] = _coerce(key, value, f"config file {file_path}")
            explicit.add(key)

    for key in _FIELDS:
        name = f"ASCENDBIND_{key.upper()}"
        if name in env:
            values[key] = _coerce(key, env[name], f"environment {name}")
            explicit.add(key)

    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown option {key!r}")
        values[key] = _coerce(key, value, f"option --{key.replace('_', '-')}")
        explicit.add(key)

    return Config(**values, explicit=frozenset(explicit))


# ---------------------------------------------------------------- CLI glue
# Every verb that plans (plan, apply, serve) gets one flag per plan-shaping key
# and --config; each flag overrides env and file exactly like SPEC §8 says.

_FLAG_HELP = {
    "device_type": "override the detected device type",
    "small_pool": "fail (default) or share: roles share CPUs when a pool is below the minimum",
    "irq_binding": "reserve two CPUs per NPU for its SQ/CQ IRQs (true/false)",
    "topology_policy": "NUMA alignment policy",
    "prefer_closest_numa": "break ties between equal-width NUMA masks by distance (true/false)",
    "max_numa_nodes": "refuse alignment on hosts with more NUMA nodes than this",
    "numa_extension": "how a one-node affinity pool is extended",
    "cpu_bind_policy": "default, or full-pcpus to keep SMT siblings together",
}


def add_config_flags(parser, *, plan_keys: bool = True) -> None:
    """Add --config and (optionally) one flag per plan-shaping key to an argparse parser."""
    parser.add_argument("--config", metavar="FILE", help=f"config file (default {DEFAULT_CONFIG_PATH} if present)")
    if not plan_keys:
        return
    for key in PLAN_KEYS:
        flag = "--" + key.replace("_", "-")
        choices = CHOICES.get(key)
        parser.add_argument(flag, dest=key, default=None, choices=choices, metavar=None if choices else "VALUE",
                            help=_FLAG_HELP.get(key))


def config_from_args(args, *, env: Mapping[str, str] | None = None) -> Config:
    """Load the config for a parsed argparse namespace made with add_config_flags."""
    overrides = {k: getattr(args, k, None) for k in PLAN_KEYS}
    return load_config(getattr(args, "config", None), env=env, overrides=overrides)
