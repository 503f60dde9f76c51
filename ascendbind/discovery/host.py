"""Assemble HostFacts / WorkerFacts from a HostSource (OWNER: discovery helper — replace this stub)."""

from __future__ import annotations

from ..config import Config
from ..model import HostFacts, WorkerFacts
from .sources import HostSource


def discover_host(source: HostSource, config: Config) -> HostFacts:
    """Run/read every static input (lscpu -e, lscpu, npu-smi info/-m/-t topo/-t board, sysfs
    node distances) through ``source`` and return HostFacts.

    Raises ToolMissing when npu-smi is absent (message says to use --snapshot),
    ParseError for malformed text (source + line), CommandFailed for failures.
    ``config.device_type`` other than "auto" overrides detection.
    """
    raise NotImplementedError


def discover_worker(source: HostSource, pid: int | None, config: Config) -> WorkerFacts:
    """Per-request facts of one worker: allowed CPUs (cgroup cpuset when readable, else
    Cpus_allowed_list), Mems_allowed, start time, environ, threads (tid, comm).

    ``pid`` None means ``/proc/self`` (the snapshot's proc/self/status).
    Raises ProcessGone when /proc/<pid>/status is absent.
    """
    raise NotImplementedError
