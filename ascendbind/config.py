"""Configuration: TOML file < ``ASCENDBIND_<KEY>`` environment < CLI flags.

Every key is optional. An unknown key in the file or a bad value anywhere is a
ConfigError naming the key and where it came from, raised at start-up.
``load_config`` is the one entry point; ``Config`` is frozen so a reload
(SIGHUP) produces a new object rather than mutating a shared one.

Values are checked, never bent: an integer key takes a whole number only
(``8.7`` is an error, not 8), a number key a finite number. An environment
variable starting ``ASCENDBIND_`` that names no key is an error too, exactly
like an unknown key in the file: a misspelt topology-policy variable,
silently ignored, would leave the operator believing a policy is in force.
The only other ``ASCENDBIND_`` variables are listed in ``OTHER_VARIABLES``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["Config", "load_config", "DEFAULT_CONFIG_PATH", "CHOICES", "PLAN_KEYS", "ENV_PREFIX", "OTHER_VARIABLES"]

DEFAULT_CONFIG_PATH = "/etc/ascendbind/config.toml"
ENV_PREFIX = "ASCENDBIND_"

# ASCENDBIND_* variables that are not config keys; every other one must name a key
OTHER_VARIABLES: dict[str, str] = {
    "ASCENDBIND_CONFIG": "path of the config file (empty: none, not even the default)",
    "ASCENDBIND_FIXTURE_HOST": "snapshot directory the fixture npu-smi replays (tests, `make run`)",
    "ASCENDBIND_FAKE_NPUS": "how many NPUs the fixture npu-smi describes (tests)",
    "ASCENDBIND_FAKE_NPU_PIDS": "pids the fixture npu-smi lists in its process table (tests, `make run`)",
    "ASCENDBIND_PLUGIN_WAIT_SECONDS": "how long the vLLM plugin waits for its process to drive an NPU (workers)",
    "ASCENDBIND_HOST_NPU_SMI": "the host npu-smi the container image's wrapper runs (deploy/kubernetes)",
}

CHOICES: dict[str, tuple[str, ...]] = {
    "device_type": ("auto", "A2", "A3", "310P", "950", "unknown"),
    "small_pool": ("fail", "share"),
    "irqbalance": ("ban", "warn", "stop"),
    "topology_policy": ("none", "best-effort", "restricted", "single-numa-node"),
    "numa_extension": ("next", "closest", "none"),
    "cpu_bind_policy": ("default", "full-pcpus"),
}

# keys that shape a plan: each has a flag on plan, apply and serve
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
    memory_check_seconds: float = 60.0
    memory_local_threshold: float = 0.8
    memory_rerun_seconds: float = 600.0
    device_type: str = "auto"
    small_pool: str = "fail"
    irqbalance: str = "ban"
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


_INT_TEXT = re.compile(r"[+-]?[0-9]+")


def _whole_number(value: Any) -> int:
    """An int from TOML, or the text of one from the environment/flags; nothing
    that would have to be rounded or guessed (8.7, "8.0", "eight", true)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        return int(value.strip())
    raise ValueError(f"expected a whole number, got {value!r}")


def _finite_number(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    else:
        raise ValueError(f"expected a number, got {value!r}")
    if not math.isfinite(out):
        raise ValueError(f"expected a finite number, got {value!r}")
    return out


def _unknown(name: str, known: list[str], what: str) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"unknown {what} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _check_env_names(env: Mapping[str, str]) -> None:
    """ConfigError for the first ASCENDBIND_* variable that is neither a key nor listed."""
    known = [ENV_PREFIX + key.upper() for key in _FIELDS] + list(OTHER_VARIABLES)
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known:
            raise ConfigError(
                f"environment: {_unknown(name, known, 'variable')}; "
                f"{ENV_PREFIX}<KEY> must name a config key"
            )


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
            out = _whole_number(value)
        elif kind is float:
            out = _finite_number(value)
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
    if key == "memory_local_threshold" and out > 1:
        raise ConfigError(f"{where}: key 'memory_local_threshold' is a share, from 0 to 1; got {out:g}")
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
                raise ConfigError(f"config file {file_path}: {_unknown(key, list(_FIELDS), 'key')}")
            values[key] = _coerce(key, value, f"config file {file_path}")
            explicit.add(key)

    _check_env_names(env)
    for key in _FIELDS:
        name = f"{ENV_PREFIX}{key.upper()}"
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
# and --config; each flag overrides env and file.

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
