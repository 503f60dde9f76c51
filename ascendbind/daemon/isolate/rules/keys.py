"""The name of one mask isolation may change. Pure.

A ``MaskKey`` is a kind and its parts, printed the way the state file keys its
record:

* ``irq:<n>``: ``/proc/irq/<n>/smp_affinity`` (hex mask text);
* ``default``: ``/proc/irq/default_smp_affinity`` (hex mask text);
* ``workqueue:<name>``: ``/sys/devices/virtual/workqueue/<name>/cpumask`` (hex);
* ``workqueues``: ``/sys/devices/virtual/workqueue/cpumask``, the mask every
  unbound workqueue without a sysfs mask of its own follows (hex);
* ``watchdog``: ``/proc/sys/kernel/watchdog_cpumask``, the CPUs the
  soft-lockup detector checks (cpu list);
* ``task:<tid>:<start time>``: one thread's affinity (cpu list text). The start
  time tells a reused id apart: a thread that exited has nothing to put back;
* ``irqbalance:<pid>``: a running irqbalance's banned CPUs. Not a key of the
  record's masks (the ban has its own entry, with the start time of the
  process): it names the ban in the mask interface, in logs and in status.

The key *is* its text (a ``str`` subclass, equal to and hashed as it): a record
loaded from the state file and one built in memory index the same map, and the
text is checked once, here, when the key is made, never split again by hand.
A workqueue name may hold ``:``; only the first one separates it from the kind.
"""

from __future__ import annotations

import re

__all__ = ["MaskKey", "KINDS", "BAN"]

KINDS = ("irq", "default", "workqueue", "workqueues", "watchdog", "task")  # the kinds the record keeps
BAN = "irqbalance"
_BARE = ("default", "workqueues", "watchdog")
_PARTS = {"irq": re.compile(r"([0-9]{1,7})"), "workqueue": re.compile(r"([A-Za-z0-9_.:-]{1,64})"),
          "task": re.compile(r"([0-9]{1,10}):([0-9]{1,20})"), BAN: re.compile(r"([0-9]{1,10})")}


class MaskKey(str):
    """One mask's name: ``kind`` and ``parts`` (ints for IRQ numbers, thread ids and
    start times; the name for a workqueue; none for the host-wide masks)."""

    kind: str
    parts: tuple[int | str, ...]

    def __new__(cls, text: str) -> MaskKey:
        if type(text) is cls:
            return text
        kind, sep, rest = text.partition(":") if isinstance(text, str) else ("", "", "")
        m = _PARTS[kind].fullmatch(rest) if sep and kind in _PARTS else None
        if m is None and (sep or text not in _BARE):
            raise ValueError(f"not an isolation mask key: {text!r}"[:200])
        key = super().__new__(cls, text)
        key.kind = kind
        key.parts = () if m is None else (rest,) if kind == "workqueue" else tuple(map(int, m.groups()))
        return key

    @classmethod
    def of(cls, kind: str, *parts: object) -> MaskKey:
        """``MaskKey.of("irq", 24)`` is ``irq:24``; ValueError for a kind or part that names no mask."""
        if kind not in KINDS and kind != BAN:
            raise ValueError(f"not an isolation mask kind: {kind!r}")
        return cls(":".join([kind, *map(str, parts)]))

    @property
    def irq(self) -> int:
        """The IRQ number of an ``irq`` key."""
        return self._part("irq", 0)

    @property
    def tid(self) -> int:
        """The thread id of a ``task`` key."""
        return self._part("task", 0)

    @property
    def start_time(self) -> int:
        """The start time of a ``task`` key (clock ticks since boot)."""
        return self._part("task", 1)

    @property
    def pid(self) -> int:
        """The process id of an ``irqbalance`` key."""
        return self._part(BAN, 0)

    @property
    def name(self) -> str:
        """The workqueue's name of a ``workqueue`` key."""
        return self._part("workqueue", 0)

    def _part(self, kind: str, i: int):
        if self.kind != kind:
            raise AttributeError(f"{self} is a {self.kind} key, not a {kind} key")
        return self.parts[i]

    def __reduce__(self):
        return (MaskKey, (str(self),))

    def __repr__(self) -> str:
        return f"MaskKey({str(self)!r})"
