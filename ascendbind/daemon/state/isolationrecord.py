"""What isolation changed on the host, as the state file keeps it. Pure.

One record for the whole host (not per worker: an IRQ's mask is narrowed for
every bound worker at once). For each mask isolation changed, keyed by what it
is:

* ``irq:<n>``: ``/proc/irq/<n>/smp_affinity`` (hex mask text);
* ``default``: ``/proc/irq/default_smp_affinity`` (hex mask text);
* ``workqueue:<name>``: ``/sys/devices/virtual/workqueue/<name>/cpumask`` (hex);
* ``workqueues``: ``/sys/devices/virtual/workqueue/cpumask``, the mask every
  unbound workqueue without a sysfs mask of its own follows (hex);
* ``watchdog``: ``/proc/sys/kernel/watchdog_cpumask``, the CPUs the
  soft-lockup detector checks (cpu list);
* ``task:<tid>:<start time>``: one thread's affinity (cpu list text): an NPU
  driver thread's, or at ``host`` any other userspace thread's. The start time
  tells a reused id apart: a thread that exited has nothing to put back.

The record of a host with many tasks is as large as the tasks isolation moved
(some 80 bytes each in the state file); hosttasks.py caps their number.

it keeps the text read before the first write (``original``, what goes back)
and every text it wrote or was about to write since (``ours``, oldest first):
a record is saved before each write, so after a crash the mask may hold the
last of them or still the one before. A mask that holds neither the original
nor one of ours was changed by its owner meanwhile, and is left as it is.

``irqbalance`` is the banned-CPU set a running irqbalance was told: which
process (pid and start time: the set lives in its memory), the set it
reported before (``original``, the hex mask of its ``setup`` reply, which
holds the operator's own bans) and the cpu lists sent since (``ours``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ...values.frozen import frozen_map

__all__ = ["SavedMask", "SavedBan", "IsolationRecord", "mask_key", "key_kind", "KINDS"]

KINDS = ("irq", "default", "workqueue", "workqueues", "watchdog", "task")
_KEY = re.compile(r"irq:[0-9]{1,7}|default|workqueues|watchdog|workqueue:[A-Za-z0-9_.:-]{1,64}|task:[0-9]{1,10}:[0-9]{1,20}")
_TEXT = re.compile(r"[0-9a-fA-F,\-]{0,8192}")
MAX_OURS = 16  # texts kept per mask: more than any sequence of saves between two successful writes


def mask_key(kind: str, *parts: object) -> str:
    """``irq:24``, ``default``, ``workqueues``, ``watchdog``, ``workqueue:dev0_sq_send_wq``, ``task:812:4711``."""
    key = ":".join([kind, *map(str, parts)])
    if kind not in KINDS or not _KEY.fullmatch(key):
        raise ValueError(f"not an isolation mask key: {key!r}")
    return key


def key_kind(key: str) -> str:
    return key.partition(":")[0]


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _TEXT.fullmatch(value):
        raise ValueError(f"{what}: not a mask or cpu list text: {value!r}"[:200])
    return value


@dataclass(frozen=True)
class SavedMask:
    original: str
    ours: tuple[str, ...] = ()

    def with_ours(self, text: str) -> SavedMask:
        """Another text about to be written (kept once, newest last, at most ``MAX_OURS``)."""
        ours = tuple(t for t in self.ours if t != text) + (text,)
        return replace(self, ours=ours[-MAX_OURS:])

    def settled(self, text: str) -> SavedMask:
        """The write of ``text`` read back: only it is ours now."""
        return replace(self, ours=(text,))

    def to_json(self) -> dict[str, Any]:
        return {"original": self.original, "ours": list(self.ours)}

    @classmethod
    def from_json(cls, d: Any, key: str) -> SavedMask:
        if not isinstance(d, dict) or not isinstance(d.get("ours"), list):
            raise ValueError(f"{key}: not a saved mask")
        return cls(_text(d.get("original"), key), tuple(_text(t, key) for t in d["ours"][-MAX_OURS:]))


@dataclass(frozen=True)
class SavedBan:
    pid: int
    start_time: int | None
    original: str
    ours: tuple[str, ...] = ()

    def with_ours(self, text: str) -> SavedBan:
        ours = tuple(t for t in self.ours if t != text) + (text,)
        return replace(self, ours=ours[-MAX_OURS:])

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "original": self.original, "ours": list(self.ours)}

    @classmethod
    def from_json(cls, d: Any) -> SavedBan:
        if not isinstance(d, dict) or not isinstance(d.get("ours"), list):
            raise ValueError("irqbalance: not a saved ban")
        pid, start = d.get("pid"), d.get("start_time")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"irqbalance: bad pid {pid!r}")
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
            raise ValueError(f"irqbalance: bad start time {start!r}")
        return cls(pid, start, _text(d.get("original"), "irqbalance"),
                   tuple(_text(t, "irqbalance") for t in d["ours"][-MAX_OURS:]))


@dataclass(frozen=True)
class IsolationRecord:
    masks: Mapping[str, SavedMask] = field(default_factory=frozen_map)
    irqbalance: SavedBan | None = None

    @property
    def empty(self) -> bool:
        return not self.masks and self.irqbalance is None

    def with_mask(self, key: str, saved: SavedMask | None) -> IsolationRecord:
        masks = dict(self.masks)
        if saved is None:
            masks.pop(key, None)
        else:
            masks[key] = saved
        return replace(self, masks=frozen_map(dict(sorted(masks.items()))))

    def with_masks(self, changes: Mapping[str, SavedMask | None]) -> IsolationRecord:
        """Many ``with_mask`` at once (None: forget that key): one copy for a batch of
        thousands of tasks, not one per task."""
        if not changes:
            return self
        masks = dict(self.masks)
        for key, saved in changes.items():
            if saved is None:
                masks.pop(key, None)
            else:
                masks[key] = saved
        return replace(self, masks=frozen_map(dict(sorted(masks.items()))))

    def with_ban(self, ban: SavedBan | None) -> IsolationRecord:
        return replace(self, irqbalance=ban)

    def to_json(self) -> dict[str, Any]:
        """The state file's ``isolation`` object ({} when nothing is changed)."""
        if self.empty:
            return {}
        out: dict[str, Any] = {"masks": {k: v.to_json() for k, v in sorted(self.masks.items())}}
        if self.irqbalance is not None:
            out["irqbalance"] = self.irqbalance.to_json()
        return out

    @classmethod
    def from_json(cls, d: Any) -> IsolationRecord:
        """Inverse of to_json; ValueError naming the entry on anything malformed."""
        if d is None or d == {}:
            return cls()
        if not isinstance(d, dict) or set(d) - {"masks", "irqbalance"} or not isinstance(d.get("masks", {}), dict):
            raise ValueError("not an isolation record")
        masks = {}
        for key, value in d.get("masks", {}).items():
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise ValueError(f"not an isolation mask key: {key!r}"[:200])
            masks[key] = SavedMask.from_json(value, key)
        ban = SavedBan.from_json(d["irqbalance"]) if d.get("irqbalance") is not None else None
        return cls(frozen_map(dict(sorted(masks.items()))), ban)
