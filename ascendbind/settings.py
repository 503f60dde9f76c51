"""Where configuration comes from: TOML file < ``ASCENDBIND_<KEY>`` environment < CLI flags.

The shell half of configuration (config.py holds the pure values and checks).
Every key is optional. An unknown key in the file or a bad value anywhere is a
ConfigError naming the key and where it came from, raised at start-up.
``load_config`` is the one entry point for the daemon and the planning verbs.

An environment variable starting ``ASCENDBIND_`` that names no key is an error
too, exactly like an unknown key in the file: a misspelt topology-policy
variable, silently ignored, would leave the operator believing a policy is in
force. The only other ``ASCENDBIND_`` variables are listed in ``OTHER_VARIABLES``.

``resolve_socket`` is the one answer to "which socket is the daemon on?" for
every client: the CLI verbs, ``ascendbind.client.Client`` and the vLLM
integration. It uses only the standard library, since workers import it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from .values.config import (CHOICES, DEFAULT_CONFIG_PATH, DEFAULT_SOCKET, ISOLATION_KEYS, KEYS, PLAN_KEYS, Config, from_layers,
                     unknown_name)
from .errors import ConfigError

__all__ = ["load_config", "add_config_flags", "config_from_args", "resolve_socket", "config_file_path",
           "ENV_PREFIX", "OTHER_VARIABLES", "SOCKET_ENV"]

ENV_PREFIX = "ASCENDBIND_"
SOCKET_ENV = ENV_PREFIX + "SOCKET"

# ASCENDBIND_* variables that are not config keys; every other one must name a key
OTHER_VARIABLES: dict[str, str] = {
    "ASCENDBIND_CONFIG": "path of the config file (empty: none, not even the default)",
    "ASCENDBIND_FIXTURE_HOST": "snapshot directory the fixture npu-smi replays (tests, `make run`)",
    "ASCENDBIND_FAKE_NPUS": "how many NPUs the fixture npu-smi describes (tests)",
    "ASCENDBIND_FAKE_NPU_PIDS": "pids the fixture npu-smi lists in its process table (tests, `make run`)",
    "ASCENDBIND_FAKE_NPU_AFFINITY": "per-NPU CPU affinity of the fixture npu-smi's NPUs (tests)",
    "ASCENDBIND_FAKE_PHY_IDS": "the Chip Phy-ID of each of the fixture npu-smi's NPUs (tests)",
    "ASCENDBIND_FAKE_CHIP": "950PR: the fixture npu-smi prints an Ascend 950's tables (tests)",
    "ASCENDBIND_PLUGIN_WAIT_SECONDS": "how long the vLLM plugin waits for its process to drive an NPU (workers)",
    "ASCENDBIND_HOST_NPU_SMI": "the host npu-smi the container image's wrapper runs (deploy/kubernetes)",
    "ASCENDBIND_TEST_STOP_AT": "record, irq, written: the daemon stops itself (SIGSTOP) at that point of every bind (tests)",
    "ASCENDBIND_KUBE_CACHE": "where the real-kubelet tests cache the kubelet they build (tests)",
    "ASCENDBIND_KUBE_IMAGE_CACHE": "where the tests cache the DaemonSet image they build (tests)",
    "ASCENDBIND_KUBE_IMAGE_DRIVER": "overlay or vfs: the storage driver of the tests' image build (tests)",
}


def _check_env_names(env: Mapping[str, str]) -> None:
    """ConfigError for the first ASCENDBIND_* variable that is neither a key nor listed."""
    known = [ENV_PREFIX + key.upper() for key in KEYS] + list(OTHER_VARIABLES)
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known:
            raise ConfigError(
                f"environment: {unknown_name(name, known, 'variable')}; "
                f"{ENV_PREFIX}<KEY> must name a config key"
            )


def config_file_path(path: str | None, env: Mapping[str, str]) -> str | None:
    """The file to read: ``path``, else ``ASCENDBIND_CONFIG`` (empty: none), else the
    default path when it exists; None for no file."""
    file_path = path if path is not None else env.get("ASCENDBIND_CONFIG")
    if file_path is None and os.path.exists(DEFAULT_CONFIG_PATH):
        file_path = DEFAULT_CONFIG_PATH
    return file_path or None


def _toml_reader() -> Any:
    """The stdlib's TOML reader from 3.11, ``tomli`` (the same code, a dependency only
    there) before. Imported here rather than at the top: a worker imports this module
    for ``resolve_socket`` alone, and its Python may lack ``tomli``."""
    if sys.version_info >= (3, 11):
        import tomllib  # novermin (3.11 and later only)
    else:  # pragma: no cover - the 3.9 and 3.10 hosts
        import tomli as tomllib
    return tomllib


def _read_toml(file_path: str) -> dict[str, Any]:
    toml = _toml_reader()
    try:
        with open(file_path, "rb") as fh:
            return toml.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {file_path} does not exist") from None
    except (OSError, toml.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {file_path}: {exc}") from None


def load_config(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build a Config from file, environment and flag overrides (None values ignored).

    ``path`` None means ``ASCENDBIND_CONFIG``, else the default path if it exists;
    an explicit path that is missing is an error.
    """
    env = os.environ if env is None else env
    layers: list[tuple[str, Mapping[str, Any]]] = []
    file_path = config_file_path(path, env)
    if file_path:
        layers.append((f"config file {file_path}", _read_toml(file_path)))
    _check_env_names(env)
    for key in KEYS:
        name = f"{ENV_PREFIX}{key.upper()}"
        if name in env:
            layers.append((f"environment {name}", {key: env[name]}))
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in KEYS:
            raise ConfigError(f"unknown option {key!r}")
        layers.append((f"option --{key.replace('_', '-')}", {key: value}))
    return from_layers(layers)


def resolve_socket(socket_path: str | None = None, *, config_path: str | None = None,
                   env: Mapping[str, str] | None = None) -> str:
    """The daemon's socket for a client: ``socket_path`` (``--socket``), else
    ``ASCENDBIND_SOCKET``, else the ``socket`` key of the config file, else the default.

    The file is the one the daemon reads (``config_path``, ``ASCENDBIND_CONFIG``, the
    default path). A file named by ``config_path`` (``--config``) must be readable and
    valid; any other may be unreadable to an unprivileged client, which then gets
    the default socket rather than an error. Only the ``socket`` key is taken from it.
    """
    if socket_path:
        return socket_path
    env = os.environ if env is None else env
    if env.get(SOCKET_ENV):
        return env[SOCKET_ENV]
    explicit = config_path is not None
    file_path = config_file_path(config_path, env)
    if not file_path:
        return DEFAULT_SOCKET
    try:
        data = _read_toml(file_path)
        if "socket" not in data:
            return DEFAULT_SOCKET
        return from_layers([(f"config file {file_path}", {"socket": data["socket"]})]).socket
    except ConfigError:
        if explicit:
            raise
        return DEFAULT_SOCKET


# ---------------------------------------------------------------- CLI glue
# Every verb that plans (plan, apply, serve) gets one flag per plan-shaping key
# and --config; plan and serve also one per isolation key. Each flag overrides env and file.

_FLAG_HELP = {
    "device_type": "override the detected device type",
    "small_pool": "fail (default) or share: roles share CPUs when a pool is below the minimum",
    "irq_binding": "reserve two CPUs per NPU for its SQ/CQ IRQs (true/false)",
    "topology_policy": "NUMA alignment policy",
    "prefer_closest_numa": "break ties between equal-width NUMA masks by distance (true/false)",
    "max_numa_nodes": "refuse alignment on hosts with more NUMA nodes than this",
    "numa_extension": "how a one-node affinity pool is extended",
    "cpu_bind_policy": "default, or full-pcpus to keep SMT siblings together",
    "pool_source": "auto (default): the worker's own cpuset as its pool where kubelet's static CPU manager "
                   "says it is exclusive, else slice; slice: the placement rules; cpuset: always the cpuset",
    "thread_classes": "thread classes, name:pattern[,pattern]:target separated by ';' (target: main, acl, release "
                      "or a share of main such as second-half or 1/4)",
    "isolation": "off (default), irqs: other IRQs leave the bound workers' CPUs; host: other tasks too",
    "housekeeping_cpus": "auto (default) or a cpu list: where the rest of the host runs",
    "isolation_exempt": "comma-separated cgroup paths (/...) and comm patterns the host level never moves",
}


def add_config_flags(parser, *, plan_keys: bool = True, isolation_keys: bool = False) -> None:
    """Add --config and (optionally) one flag per plan-shaping key, and one per isolation
    key, to an argparse parser."""
    parser.add_argument("--config", metavar="FILE", help=f"config file (default {DEFAULT_CONFIG_PATH} if present)")
    keys = (PLAN_KEYS if plan_keys else ()) + (ISOLATION_KEYS if isolation_keys else ())
    for key in keys:
        flag = "--" + key.replace("_", "-")
        choices = CHOICES.get(key)
        parser.add_argument(flag, dest=key, default=None, choices=choices, metavar=None if choices else "VALUE",
                            help=_FLAG_HELP.get(key))


def config_from_args(args, *, env: Mapping[str, str] | None = None) -> Config:
    """Load the config for a parsed argparse namespace made with add_config_flags."""
    overrides = {k: getattr(args, k, None) for k in PLAN_KEYS + ISOLATION_KEYS}
    return load_config(getattr(args, "config", None), env=env, overrides=overrides)
