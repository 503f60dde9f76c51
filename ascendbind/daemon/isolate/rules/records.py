"""What isolation changed on the host, as the state file keeps it. Pure.

One record for the whole host (not per worker: an IRQ's mask is narrowed for
every bound worker at once), keyed by ``MaskKey`` (keys.py). For each mask it
keeps the text read before the first write (``original``, what goes back) and
every text it wrote or was about to write since (``ours``, oldest first): a
record is saved before each write, so after a crash the mask may hold the last
of them or still the one before. Each kind has its own record type, which
knows how its texts read as CPUs (a hex mask for an IRQ's, the default IRQ
mask and the workqueues', a cpu list for the watchdog's and a thread's):
verdicts.py compares CPUs, never texts, so a mask the kernel prints at another
width is still the same mask.

The record of a host with many tasks is as large as the tasks isolation moved
(some 80 bytes each in the state file); hosttasks.py caps their number.

``irqbalance`` (``SavedBan``) is the banned-CPU set a running irqbalance was
told: which process (pid and start time: the set lives in its memory), the set
it reported before (``original``, the hex mask of its ``setup`` reply, which
holds the operator's own bans) and the cpu lists sent since (``ours``).

The state file's JSON is the same for every type: ``{"original": text, "ours":
[text, ...]}`` under the key's text, and the ban's object beside the masks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ....values.cpulist import parse_cpulist, parse_mask
from ....values.frozen import frozen_map
from .keys import MaskKey

__all__ = ["SavedMask", "IrqSaved", "DefaultSaved", "WorkqueueSaved", "WorkqueuesSaved", "WatchdogSaved",
           "TaskSaved", "SavedBan", "RECORD_TYPES", "IsolationRecord", "hex_cpus", "list_cpus", "MAX_OURS"]

_TEXT = re.compile(r"[0-9a-fA-F,\-]{0,8192}")
MAX_OURS = 16  # texts kept per mask: more than any sequence of saves between two successful writes


def hex_cpus(text: str) -> frozenset[int] | None:
    """The CPUs of a hex mask text (None: not one)."""
    try:
        return parse_mask(text)
    except ValueError:
        return None


def list_cpus(text: str) -> frozenset[int] | None:
    """The CPUs of a cpu list text (None: not one)."""
    try:
        return parse_cpulist(text)
    except ValueError:
        return None


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _TEXT.fullmatch(value):
        raise ValueError(f"{what}: not a mask or cpu list text: {value!r}"[:200])
    return value


def _ours(value: Any, what: str) -> tuple[str, ...]:
    return tuple([_text(t, what) for t in value[-MAX_OURS:]])


class _Texts:
    """What every record holds: ``original`` and ``ours``, read as CPUs by its kind's
    ``original_cpus`` and ``ours_cpus`` (the one thing the kinds differ in here)."""

    original: str
    ours: tuple[str, ...]
    original_format: ClassVar[Callable[[str], frozenset[int] | None]] = staticmethod(hex_cpus)
    ours_format: ClassVar[Callable[[str], frozenset[int] | None]] = staticmethod(hex_cpus)

    def original_cpus(self) -> frozenset[int] | None:
        return type(self).original_format(self.original)

    def ours_cpus(self) -> list[frozenset[int] | None]:
        parse = type(self).ours_format
        return [parse(t) for t in self.ours]

    def with_ours(self, text: str):
        """Another text about to be written (kept once, newest last, at most ``MAX_OURS``)."""
        ours = tuple(t for t in self.ours if t != text) + (text,)
        return replace(self, ours=ours[-MAX_OURS:])

    def settled(self, text: str):
        """The write of ``text`` read back: only it is ours now."""
        return replace(self, ours=(text,))


@dataclass(frozen=True)
class SavedMask(_Texts):
    """A mask's record; the base of each kind's own type (``RECORD_TYPES``)."""

    original: str
    ours: tuple[str, ...] = ()
    kind: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        return {"original": self.original, "ours": list(self.ours)}

    @classmethod
    def from_json(cls, d: Any, key: str) -> SavedMask:
        if not isinstance(d, dict) or not isinstance(d.get("ours"), list):
            raise ValueError(f"{key}: not a saved mask")
        return cls(_text(d.get("original"), key), _ours(d["ours"], key))


def _kind(kind: str, doc: str, texts: Callable[[str], frozenset[int] | None] = hex_cpus) -> type[SavedMask]:
    """The record type of one kind: a ``SavedMask`` whose texts read with ``texts``."""
    return type(f"{kind.capitalize()}Saved", (SavedMask,), {
        "__doc__": doc, "__module__": __name__, "kind": kind,
        "original_format": staticmethod(texts), "ours_format": staticmethod(texts)})


IrqSaved = _kind("irq", "An IRQ's ``smp_affinity`` (hex).")
DefaultSaved = _kind("default", "``default_smp_affinity``, the mask a new IRQ starts with (hex).")
WorkqueueSaved = _kind("workqueue", "One workqueue's ``cpumask`` (hex).")
WorkqueuesSaved = _kind("workqueues", "The unbound workqueues' shared ``cpumask`` (hex).")
WatchdogSaved = _kind("watchdog", "``watchdog_cpumask`` (a cpu list).", list_cpus)
TaskSaved = _kind("task", "One thread's affinity (a cpu list).", list_cpus)
RECORD_TYPES: dict[str, type[SavedMask]] = {t.kind: t for t in (IrqSaved, DefaultSaved, WorkqueueSaved,
                                                                  WorkqueuesSaved, WatchdogSaved, TaskSaved)}


@dataclass(frozen=True)
class SavedBan(_Texts):
    """irqbalance's banned CPUs: its ``setup`` reply's hex mask before, the cpu lists sent since."""

    pid: int
    start_time: int | None
    original: str
    ours: tuple[str, ...] = ()
    ours_format = staticmethod(list_cpus)

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
        return cls(pid, start, _text(d.get("original"), "irqbalance"), _ours(d["ours"], "irqbalance"))




@dataclass(frozen=True)
class IsolationRecord:
    masks: Mapping[MaskKey, SavedMask] = field(default_factory=frozen_map)
    irqbalance: SavedBan | None = None

    def __post_init__(self) -> None:
        # every key a MaskKey, whoever made the map (one pass; none is made again once all are)
        if any(type(k) is not MaskKey for k in self.masks):
            object.__setattr__(self, "masks", frozen_map({MaskKey(k): v for k, v in self.masks.items()}))

    @property
    def empty(self) -> bool:
        return not self.masks and self.irqbalance is None

    def with_masks(self, changes: Mapping[str, SavedMask | None]) -> IsolationRecord:
        """The record with ``changes`` (None: forget that key) made at once: one copy for a
        batch of thousands of tasks, not one per task. The map keeps no order (``to_json``
        sorts the keys; whoever needs an order sorts)."""
        if not changes:
            return self
        masks = dict(self.masks)
        for key, saved in changes.items():
            if saved is None:
                masks.pop(key, None)
            else:
                masks[key] = saved
        return replace(self, masks=frozen_map(masks))

    def with_ban(self, ban: SavedBan | None) -> IsolationRecord:
        return replace(self, irqbalance=ban)

    def of_kind(self, kind: str) -> dict[MaskKey, SavedMask]:
        return {k: v for k, v in self.masks.items() if k.kind == kind}

    def to_json(self) -> dict[str, Any]:
        """The state file's ``isolation`` object ({} when nothing is changed)."""
        if self.empty:
            return {}
        # sorted as plain text: a sort of str subclasses takes Python's slow path, some 2x at 16k tasks
        out: dict[str, Any] = {"masks": dict(sorted((str(k), v.to_json()) for k, v in self.masks.items()))}
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
        for text, value in d.get("masks", {}).items():
            key = MaskKey(text)
            if key.kind not in RECORD_TYPES:
                raise ValueError(f"not an isolation mask key: {text!r}"[:200])
            masks[key] = RECORD_TYPES[key.kind].from_json(value, key)
        ban = SavedBan.from_json(d["irqbalance"]) if d.get("irqbalance") is not None else None
        return cls(frozen_map(masks), ban)
