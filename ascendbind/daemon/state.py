"""The daemon's checkpoint: ``state_dir/state.json``.

What it holds: one entry per bound worker (pid, start time, NPUs, plan, the
affinity before binding, the IRQ masks saved before the first write, the step
results), so that a restarted daemon keeps reconciling its workers and
``release`` can still undo what an earlier daemon did.

Invariants:
* Written atomically: a temp file in the same directory, fsync, rename, fsync of
  the directory. A reader sees the old file or the new one, never half of one.
* Versioned (``version``) and checksummed (sha256 over the canonical JSON of
  ``version``, ``boot_id`` and ``workers``). A file that fails to parse, has an
  unknown version or a bad checksum is *corrupt*: it is moved aside
  (``state.json.corrupt-<unix time>``) with a log line, and the daemon starts
  empty. Never a crash loop.
* Permission-checked: the daemon acts as root on the pids and IRQ masks in this
  file, so a file (or directory) that another user owns or can write is not
  trusted: moved aside like a corrupt one.
* Stamped with the boot id (``/proc/sys/kernel/random/boot_id``): entries of
  another boot name pids and IRQ masks of a machine that no longer exists; they
  are dropped without restoring anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..model import Binding, Outcome, Plan, Reason, Step, StepResult, frozen_map

__all__ = ["StateFile", "LoadResult", "binding_to_json", "binding_from_json", "read_boot_id", "STATE_VERSION"]

STATE_VERSION = 1
log = structlog.get_logger("ascendbind.state")


def read_boot_id(proc_root: str = "/proc") -> str:
    try:
        with open(os.path.join(proc_root, "sys/kernel/random/boot_id"), encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def binding_to_json(b: Binding, **extra: Any) -> dict[str, Any]:
    out = {
        "pid": b.pid,
        "start_time": b.start_time,
        "npus": list(b.npus),
        "plan": b.plan.to_json(),
        "original_cpus": sorted(b.original_cpus),
        "saved_irq_masks": {str(k): v for k, v in sorted(b.saved_irq_masks.items())},
        "steps": [s.to_json() for s in b.steps],
    }
    out.update(extra)
    return out


def _step_from_json(d: dict[str, Any]) -> StepResult:
    return StepResult(
        step=Step(d["step"]),
        outcome=Outcome(d["outcome"]),
        reason=Reason(d["reason"]) if d.get("reason") else None,
        detail=str(d.get("detail", "")),
        data=frozen_map(d.get("data") or {}),
    )


def binding_from_json(d: dict[str, Any]) -> Binding:
    """Inverse of binding_to_json; raises KeyError/ValueError/TypeError on a malformed entry."""
    pid = d["pid"]
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"bad pid {pid!r}")
    return Binding(
        pid=pid,
        start_time=d.get("start_time"),
        npus=tuple(int(n) for n in d["npus"]),
        plan=Plan.from_json(d["plan"]),
        original_cpus=frozenset(int(c) for c in d["original_cpus"]),
        saved_irq_masks=frozen_map({int(k): str(v) for k, v in d.get("saved_irq_masks", {}).items()}),
        steps=tuple(_step_from_json(s) for s in d.get("steps", ())),
    )


def _checksum(version: int, boot_id: str, workers: list) -> str:
    canon = json.dumps({"version": version, "boot_id": boot_id, "workers": workers}, sort_keys=True,
                       separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclass
class LoadResult:
    workers: list[dict[str, Any]] = field(default_factory=list)  # entries of this boot, raw
    other_boot: int = 0  # entries dropped because they belong to another boot
    moved_aside: str | None = None  # where a corrupt/untrusted file went
    problem: str | None = None  # why it was moved aside


class StateFile:
    def __init__(self, state_dir: str, *, proc_root: str = "/proc") -> None:
        self.dir = state_dir
        self.path = os.path.join(state_dir, "state.json")
        self.boot_id = read_boot_id(proc_root)

    def ensure_dir(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def save(self, workers: list[dict[str, Any]]) -> None:
        self.ensure_dir()
        doc = {
            "version": STATE_VERSION,
            "boot_id": self.boot_id,
            "written_at": time.time(),
            "checksum": _checksum(STATE_VERSION, self.boot_id, workers),
            "workers": workers,
        }
        data = json.dumps(doc, indent=1, sort_keys=True).encode()
        tmp = f"{self.path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _untrusted(self, st: os.stat_result, what: str) -> str | None:
        if st.st_uid != os.geteuid():
            return f"{what} is owned by uid {st.st_uid}, not {os.geteuid()}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        return None

    def _move_aside(self, problem: str) -> LoadResult:
        dest = f"{self.path}.corrupt-{int(time.time())}"
        try:
            os.replace(self.path, dest)
        except OSError as exc:
            dest = f"(could not move: {exc.strerror})"
        log.error("state file not used", path=self.path, problem=problem, moved_to=dest)
        return LoadResult(moved_aside=dest, problem=problem)

    def load(self) -> LoadResult:
        try:
            dst = os.stat(self.dir)
        except FileNotFoundError:
            return LoadResult()
        problem = self._untrusted(dst, f"state directory {self.dir}")
        if problem:
            # the directory itself is not ours: do not even open files in it
            log.error("state directory not trusted; starting empty", problem=problem)
            return LoadResult(problem=problem)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return LoadResult()
        except OSError as exc:
            return self._move_aside(f"cannot open: {exc.strerror}")
        try:
            problem = self._untrusted(os.fstat(fd), f"state file {self.path}")
            if problem:
                return self._move_aside(problem)
            with os.fdopen(fd, "rb", closefd=False) as fh:
                raw = fh.read(64 << 20)
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("top level is not an object")
            version, boot_id, workers = doc["version"], doc["boot_id"], doc["workers"]
            if version != STATE_VERSION:
                raise ValueError(f"unknown version {version!r} (this daemon writes {STATE_VERSION})")
            if not isinstance(workers, list) or not isinstance(boot_id, str):
                raise ValueError("workers is not a list or boot_id is not a string")
            if doc.get("checksum") != _checksum(version, boot_id, workers):
                raise ValueError("checksum mismatch")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            return self._move_aside(f"corrupt: {exc}")
        if boot_id != self.boot_id:
            log.info("state file is from another boot; dropping its workers without touching IRQs",
                     workers=len(workers), file_boot_id=boot_id)
            return LoadResult(other_boot=len(workers))
        return LoadResult(workers=[w for w in workers if isinstance(w, dict)])
