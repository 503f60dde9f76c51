"""Record a live host into a snapshot directory: what users attach to bug reports.

The recorder does not keep its own list of files to copy: it wraps the live
host in a RecordingHost and runs the real discovery through it, so the
snapshot holds exactly what discovery read (command output under ``cmd/``,
/proc and /sys files under the same relative paths), the IRQ step's discovery
included (each NPU's ``msi_irqs`` directory and ``/proc/interrupts``). On top
of that it records the NUMA node lists and ``meta.json``; with a pid,
also the worker's ``numa_maps``, which the daemon's memory-locality check reads
(it names the files the worker maps, never their contents).

``/proc/<pid>/environ`` is never written: environments carry secrets (API
keys, tokens). Only the Ascend variables the target rule reads
(``ASCEND_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``,
``ASCEND_RUNTIME_OPTIONS``) go to ``meta.json``'s ``env``, which is where a
SnapshotHost looks when environ is absent. A link discovery reads (a namespace
link) is written as a file holding its target, and a ``/dev`` listing as a file
of ``NAME MAJOR:MINOR`` lines, since a snapshot holds neither links nor device
nodes.

A failing or missing npu-smi still yields a snapshot of everything else, with
the reason in ``meta.json``'s ``warnings`` and on the returned list, because a
host whose npu-smi output does not parse is exactly what a bug report is for.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence

from ...values.config import Config
from ...errors import DiscoveryError, UsageError
from ...values.reasons import Reason
from ...values.targeting import ASCEND_ENV
from ..parse.devices import format_char_devices
from .host import NODE_ROOT, discover_cpu_topology, discover_host
from .irqhost import INTERRUPTS, discover_npu_irqs, msi_dir
from ..parse.kubelet import CHECKPOINT_LIMIT, CHECKPOINT_PATH
from ..read.sources import HostSource, LiveHost, OneTimeoutPerTool, command_file_name
from .worker import discover_worker

__all__ = ["RecordingHost", "SnapshotFiles", "record_snapshot", "check_snapshot_target", "RECORDED_ENV"]

RECORDED_ENV = ASCEND_ENV


class RecordingHost:
    """A HostSource that answers from ``inner`` and writes what it answered under ``directory``."""

    def __init__(self, inner: HostSource, directory: str) -> None:
        self.inner = inner
        self.directory = os.path.abspath(directory)
        self.written: set[str] = set()

    def _target(self, rel: str) -> str:
        rel = os.path.normpath(rel.lstrip("/"))
        if rel.startswith("..") or os.path.isabs(rel):
            raise UsageError(f"refusing to record outside the snapshot: {rel}")
        return os.path.join(self.directory, rel)

    def _write(self, rel: str, text: str) -> None:
        path = self._target(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        self.written.add(os.path.relpath(path, self.directory))

    def run(self, argv: Sequence[str]) -> str | None:
        out = self.inner.run(argv)
        if out is not None:
            self._write(os.path.join("cmd", command_file_name(argv).replace("/", "_")), out)
        return out

    def read(self, path: str, limit: int | None = None) -> str | None:
        text = self.inner.read(path) if limit is None else self.inner.read(path, limit=limit)
        if text is not None and not path.endswith("/environ"):
            self._write(path, text)
        return text

    def readlink(self, path: str) -> str | None:
        inner = getattr(self.inner, "readlink", None)
        target = inner(path) if inner is not None else None
        if target is not None:
            self._write(path, target + "\n")
        return target

    def char_devices(self, path: str, major: int):
        inner = getattr(self.inner, "char_devices", None)
        nodes = inner(path, major) if inner is not None else None
        if nodes is not None:
            self._write(path, format_char_devices(nodes))
        return nodes

    def listdir(self, path: str) -> list[str] | None:
        names = self.inner.listdir(path)
        if names is None:
            return None
        base = self._target(path)
        os.makedirs(base, exist_ok=True)
        live_path = getattr(self.inner, "host_path", lambda p: p)
        for name in names:
            if "/" in name or name in (".", ".."):
                continue
            entry = os.path.join(base, name)
            if os.path.isdir(live_path(f"{path.rstrip('/')}/{name}")):
                os.makedirs(entry, exist_ok=True)
            elif not os.path.exists(entry):
                # e.g. msi_irqs/<irq>: the name is the fact, the content is not read
                open(entry, "w").close()
                self.written.add(os.path.relpath(entry, self.directory))
        return names


class SnapshotFiles(list):
    """The relative paths written (a plain ``list[str]``), plus ``warnings``:
    what could not be recorded and why (npu-smi missing, unparsable output ...)."""

    def __init__(self, files: Sequence[str], warnings: Sequence[str]) -> None:
        super().__init__(files)
        self.warnings = list(warnings)


# pseudo-filesystems: "writing a snapshot" there would poke kernel knobs or make cgroups
_PSEUDO_FS = ("/proc", "/sys", "/dev")


def check_snapshot_target(out_dir: str) -> None:
    """UsageError unless ``out_dir`` can become a new snapshot directory: absent or
    empty, on a real filesystem, under a directory (not a file) we may write to."""
    real = os.path.realpath(out_dir)
    for top in _PSEUDO_FS:
        if real == top or real.startswith(top + "/"):
            raise UsageError(f"snapshot directory {out_dir} is under {top}; pick a directory on a real filesystem")
    if os.path.isdir(out_dir):
        try:
            entries = os.listdir(out_dir)
        except OSError as exc:
            raise UsageError(f"snapshot directory {out_dir} is unreadable: {exc.strerror}") from None
        if entries:
            raise UsageError(f"snapshot directory {out_dir} is not empty; pick a new one")
        parent = out_dir
    elif os.path.lexists(out_dir):
        raise UsageError(f"snapshot target {out_dir} exists and is not a directory")
    else:
        parent = os.path.dirname(os.path.abspath(out_dir))
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise UsageError(f"snapshot directory {out_dir} is under {parent}, which is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"snapshot directory {out_dir}: cannot write to {parent}")


def record_snapshot(out_dir: str, pid: int | None, config: Config) -> SnapshotFiles:
    """Record this host (and worker ``pid``, or this process when None) into ``out_dir``.

    ``out_dir`` must be absent or empty. Raises ProcessGone for a pid that does
    not exist, UsageError for a target that cannot become a snapshot (not
    empty, under a file or a pseudo-filesystem, unwritable, a write failing
    half-way); discovery problems become warnings, the raw text that caused
    them is in the snapshot.
    """
    check_snapshot_target(out_dir)
    try:
        return _record(out_dir, pid, config)
    except OSError as exc:
        where = exc.filename or out_dir
        raise UsageError(f"cannot write the snapshot: {where}: {exc.strerror or exc}") from None


def _record(out_dir: str, pid: int | None, config: Config) -> SnapshotFiles:
    # one hung npu-smi costs one timeout, not one per board query
    rec = RecordingHost(OneTimeoutPerTool(LiveHost.from_config(config)), out_dir)
    warnings: list[str] = []

    # the worker first: a wrong --pid fails before anything is written
    worker = None
    try:
        worker = discover_worker(rec, pid, config, want_uvb=True)
    except DiscoveryError as exc:
        warnings.append(f"worker: {exc}")

    facts = None
    try:
        facts = discover_host(rec, config)
        warnings.extend(facts.warnings)
    except DiscoveryError as exc:
        warnings.append(str(exc))
        try:
            discover_cpu_topology(rec)
        except DiscoveryError as exc2:
            warnings.append(str(exc2))

    # the IRQ step's discovery, run through the recorder for every NPU, so that
    # `plan --snapshot` shows the IRQs a bind would move; the interrupt table is
    # kept even when no NPU has MSI vectors (it is what a report about that needs)
    if facts is not None:
        found = discover_npu_irqs(rec, facts, facts.logic_ids)
        warnings.extend(f"no {msi_dir(i.pci)} on this host" for i in found.values()
                        if i.reason is Reason.NO_MSI_IRQS and i.pci)
    rec.read(INTERRUPTS)
    # kubelet's CPU manager checkpoint, when this is a Kubernetes node: whether a pod's CPUs are its own
    rec.read(CHECKPOINT_PATH, limit=CHECKPOINT_LIMIT)
    if worker is not None and pid is not None:
        # the locality check's input; without --pid the "worker" is this process,
        # whose memory map would tell a bug report nothing
        rec.read(f"/proc/{worker.pid}/numa_maps")
    rec.read("/sys/devices/system/cpu/online")
    rec.read(f"{NODE_ROOT}/online")
    for node in sorted(facts.numa_nodes if facts else ()):
        rec.read(f"{NODE_ROOT}/node{node}/cpulist")

    env = {}
    if worker is not None:
        env = {k: worker.env[k] for k in RECORDED_ENV if k in worker.env}
    meta = {
        "arch": platform.machine(),
        "env": env,
        "pid": worker.pid if (worker is not None and pid is not None) else None,
        "warnings": warnings,
    }
    os.makedirs(rec.directory, exist_ok=True)
    with open(os.path.join(rec.directory, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2, sort_keys=True)
        fh.write("\n")
    rec.written.add("meta.json")
    return SnapshotFiles(sorted(rec.written), warnings)
