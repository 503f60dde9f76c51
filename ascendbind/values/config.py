"""Configuration values: the keys, their defaults, choices and checks.

This module is pure: it reads no file and no environment, so the planner can
import it and plan a host from a snapshot anywhere. Where values come from (the
TOML file, ``ASCENDBIND_<KEY>`` variables, command-line flags) is the shell's
business: ascendbind/settings.py layers them and hands each value through
``coerce`` here, naming its source for the error.

Values are checked, never bent: an integer key takes a whole number only
(``8.7`` is an error, not 8), a number key a finite number, a choice key one of
its ``CHOICES``. ``Config`` is frozen, so a reload (SIGHUP) produces a new
object rather than mutating a shared one; ``Config(...)`` and
``config.replace(...)`` check every value the same way a loader does.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .cpulist import parse_cpulist
from .threadclass import ThreadClass, parse_thread_classes
from ..errors import ConfigError

__all__ = ["Config", "CHOICES", "PLAN_KEYS", "ISOLATION_KEYS", "KEYS", "DEFAULT_CONFIG_PATH", "DEFAULT_SOCKET",
           "coerce", "from_layers", "unknown_name", "exempt_entries"]

DEFAULT_CONFIG_PATH = "/etc/ascendbind/config.toml"
DEFAULT_SOCKET = "/run/ascendbind/ascendbind.sock"

CHOICES: dict[str, tuple[str, ...]] = {
    "device_type": ("auto", "A2", "A3", "310P", "950", "unknown"),
    "small_pool": ("fail", "share"),
    "irqbalance": ("ban", "warn", "stop"),
    "topology_policy": ("none", "best-effort", "restricted", "single-numa-node"),
    "numa_extension": ("next", "closest", "none"),
    "cpu_bind_policy": ("default", "full-pcpus"),
    "isolation": ("off", "irqs", "host"),
    "pool_source": ("auto", "slice", "cpuset"),
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
    "pool_source",
    "thread_classes",
)

# keys that say what else leaves the bound workers' CPUs: they never change a plan, so
# their flags are on plan (which shows what the level does) and serve only
ISOLATION_KEYS = (
    "isolation",
    "housekeeping_cpus",
    "isolation_exempt",
)


@dataclass(frozen=True)
class Config:
    socket: str = DEFAULT_SOCKET
    state_dir: str = "/var/lib/ascendbind"
    metrics_listen: str = "127.0.0.1:9464"
    reconcile_seconds: float = 5.0
    thread_events: bool = True
    thread_event_budget: int = 2000
    drift_sweep_passes: int = 4
    memory_check_seconds: float = 300.0
    memory_local_threshold: float = 0.8
    memory_rerun_seconds: float = 600.0
    memory_move_gib_per_second: float = 2.0
    memory_moves_per_node: int = 1
    device_type: str = "auto"
    small_pool: str = "fail"
    irqbalance: str = "ban"
    irq_binding: bool = True
    topology_policy: str = "none"
    prefer_closest_numa: bool = False
    max_numa_nodes: int = 8
    numa_extension: str = "next"
    cpu_bind_policy: str = "default"
    pool_source: str = "auto"
    # ordered (pattern -> role or share of main) rows in front of the built-in thread rules: threadclass.py
    thread_classes: tuple[ThreadClass, ...] = ()
    isolation: str = "off"
    housekeeping_cpus: str = "auto"
    isolation_exempt: tuple[str, ...] = ()
    socket_group: str = ""
    allow_shared_npu: bool = False
    auto_bind: bool = False
    auto_bind_seconds: float = 30.0
    npu_smi: str = "npu-smi"
    command_timeout_seconds: float = 10.0
    proc_root: str = "/proc"
    sys_root: str = "/sys"
    kubelet_root: str = "/var/lib/kubelet"
    # which keys were set explicitly (file, env or flag) rather than defaulted;
    # the policy precedence rule needs to know whether the node named a policy
    explicit: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # one check for every way a Config is made: a value that would not load
        # from the file must not slip in through Config(...) or replace(...)
        for key in KEYS:
            value = getattr(self, key)
            checked = coerce(key, value, "config")
            if checked is not value:
                object.__setattr__(self, key, checked)
        unknown = set(self.explicit) - set(KEYS)
        if unknown:
            raise ConfigError(f"config: explicit names no key: {', '.join(sorted(unknown))}")
        if not isinstance(self.explicit, frozenset):
            object.__setattr__(self, "explicit", frozenset(self.explicit))

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in dataclasses.fields(Config) if f.name != "explicit"}
KEYS: tuple[str, ...] = tuple(_FIELDS)

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


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _string_list(value: Any) -> tuple[str, ...]:
    """A TOML array of strings, or the text of one from the environment or a flag:
    comma-separated items, blanks around them dropped ("" is the empty list)."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"expected a list of strings, got {value!r}")
        items = [v.strip() for v in value]
    elif isinstance(value, str):
        items = [v.strip() for v in value.split(",")] if value.strip() else []
    else:
        raise ValueError(f"expected a list of strings, got {value!r}")
    if any(not v for v in items):
        raise ValueError(f"empty entry in {value!r}")
    return tuple(items)


def _cpulist_problem(text: str) -> str | None:
    try:
        cpus = parse_cpulist(text)
    except ValueError as exc:
        return str(exc)
    return None if cpus else "an empty list leaves nothing to run the rest of the host on"


_COMM_CHARS = re.compile(r"[ -~]+")


def _exempt_problem(entry: str) -> str | None:
    """Why ``entry`` is neither a cgroup path ("/system.slice/agent.service": that cgroup and
    those below it) nor a comm pattern ("agent*": shell-style, matched against a task's
    15-character name); None when it is one of them."""
    if len(entry) > 4096:
        return "is longer than 4096 characters"
    if not _COMM_CHARS.fullmatch(entry):
        return "has characters other than printable ASCII"
    if entry.startswith("/"):
        parts = entry.strip("/").split("/") if entry != "/" else []
        if not parts:
            return "names the root cgroup, which holds every process: exempt nothing or name a cgroup below it"
        if any(p in ("", ".", "..") for p in parts):
            return "is not a plain cgroup path (an empty, '.' or '..' component)"
        return None
    if len(entry) > 64:
        return "is a comm pattern longer than 64 characters (a task's name has at most 15)"
    if "/" in entry:
        return "holds '/' but does not start with it: a cgroup path starts with '/', a comm pattern has none"
    return None


def exempt_entries(entries: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(cgroup paths, comm patterns) of checked ``isolation_exempt`` entries."""
    entries = tuple(entries)
    return (tuple(e.rstrip("/") for e in entries if e.startswith("/")),
            tuple(e for e in entries if not e.startswith("/")))


def unknown_name(name: str, known: Iterable[str], what: str) -> str:
    """``unknown key 'x' (did you mean 'y'?)``: the message for a misspelt name."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"unknown {what} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def coerce(key: str, value: Any, where: str) -> Any:
    """``value`` for ``key`` checked and typed, from any source (TOML value, text of a
    variable or flag); ConfigError naming ``where`` and the key otherwise. A value
    already of the right type comes back as the same object."""
    if key not in _FIELDS:
        raise ConfigError(f"{where}: {unknown_name(key, KEYS, 'key')}")
    kind = type(_FIELDS[key].default)
    try:
        if key == "thread_classes":
            out: Any = parse_thread_classes(value)
        elif kind is bool:
            out = _boolean(value)
        elif kind is int:
            out = _whole_number(value)
        elif kind is float:
            out = value if type(value) is float and math.isfinite(value) else _finite_number(value)
            if out < 0:
                raise ValueError(f"expected a non-negative number, got {value!r}")
        elif kind is tuple:
            out = _string_list(value)
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
    if key == "thread_event_budget" and not 10 <= out <= 1_000_000:
        raise ConfigError(f"{where}: key 'thread_event_budget' must be from 10 to 1000000 events a second; got {out}")
    if key == "drift_sweep_passes" and not 1 <= out <= 1000:
        raise ConfigError(f"{where}: key 'drift_sweep_passes' must be from 1 to 1000; got {out}")
    if key == "memory_moves_per_node" and not 1 <= out <= 64:
        raise ConfigError(f"{where}: key 'memory_moves_per_node' must be from 1 to 64; got {out}")
    if key == "max_numa_nodes" and out < 1:
        raise ConfigError(f"{where}: key 'max_numa_nodes' must be at least 1; got {out}")
    if key == "housekeeping_cpus" and out != "auto":
        why = _cpulist_problem(out)
        if why:
            raise ConfigError(f"{where}: key 'housekeeping_cpus' is 'auto' or a cpu list such as '0-3,64'; {why}")
    if key == "isolation_exempt":
        for entry in out:
            why = _exempt_problem(entry)
            if why:
                raise ConfigError(f"{where}: key 'isolation_exempt': entry {entry[:80]!r} {why}")
    if key == "metrics_listen" and out and out.rpartition(":")[1] != ":":
        raise ConfigError(f"{where}: key 'metrics_listen' must be host:port (or empty to disable); got {out!r}")
    return out


def from_layers(layers: Iterable[tuple[str, Mapping[str, Any]]]) -> Config:
    """A Config from ``(where, values)`` layers, later layers winning; a None value is
    no value (a flag not given). Every key a layer sets counts as explicit."""
    values: dict[str, Any] = {}
    for where, layer in layers:
        for key, value in layer.items():
            if value is not None:
                values[key] = coerce(key, value, where)
    return Config(**values, explicit=frozenset(values))
