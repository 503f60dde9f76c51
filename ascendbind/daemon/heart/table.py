"""The held table as a value, and the read-only view the other rooms get of it.

``Table`` maps pid -> ``Holding``: what the daemon holds a worker by (its binding,
and what proves it drives its NPUs). Both are frozen: a change is a new table,
made by ``step`` (step.py) alone. The reconcile loop's memory of a worker (its
thread cache, drift counts, memory checks, its pidfd) is not the table's: it
lives in the mutable ``Held`` record (watch/held.py) beside it, which the
``Daemon`` keeps in line with the table.

``Reader`` is kubelet's ``state.Reader`` idea: what a room is given to read the
held workers with. It never hands out the daemon's lock; what it returns is a
copy made under that lock, so a room iterates it while binds go on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ...values.frozen import frozen_map
from ...values.model import Binding
from ..watch.proof import Proof

__all__ = ["Holding", "Table", "Reader", "EMPTY"]


@dataclass(frozen=True)
class Holding:
    """One held worker as the table knows it."""

    binding: Binding
    proof: Proof

    @property
    def pid(self) -> int:
        return self.binding.pid

    def drives(self, npus: Collection[int]) -> bool:
        return bool(set(self.binding.npus) & set(npus))


@dataclass(frozen=True)
class Table:
    """pid -> Holding, one per held worker."""

    held: Mapping[int, Holding] = field(default_factory=lambda: frozen_map({}))

    def __contains__(self, pid: object) -> bool:
        return pid in self.held

    def __len__(self) -> int:
        return len(self.held)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.held))

    def get(self, pid: int) -> Holding | None:
        return self.held.get(pid)

    def with_(self, *holdings: Holding) -> Table:
        return Table(frozen_map({**self.held, **{h.pid: h for h in holdings}}))

    def without(self, *pids: int) -> Table:
        if not any(p in self.held for p in pids):
            return self  # nothing to take out: the same value (a bind that replaces nobody)
        return Table(frozen_map({p: h for p, h in self.held.items() if p not in pids}))

    def rebound(self, pid: int, binding: Binding) -> Table:
        """The table with ``pid``'s binding replaced (its proof kept)."""
        return self.with_(replace(self.held[pid], binding=binding))

    @classmethod
    def of(cls, holdings: Iterable[Holding]) -> Table:
        return cls(frozen_map({h.pid: h for h in holdings}))


EMPTY = Table()


class Reader:
    """What a room reads the held workers through: copies made under the daemon's lock
    (``records``), one record (``get``), whether one is still held as it was
    (``current``), and the table as a value (``table``). ``locked`` and ``records`` are
    the ``Daemon``'s; a room is handed the reader, never the lock."""

    def __init__(self, locked: Callable[[Callable[[], Any]], Any], records: Callable[[], Mapping[int, Any]],
                 table: Callable[[], Table]) -> None:
        self._locked, self._records, self._table = locked, records, table

    def read(self, answer: Callable[[Mapping[int, Any]], Any]) -> Any:
        """``answer(records)`` while no bind, release or look changes the table: an answer
        that must show one moment (every worker of a status, each as it was then)."""
        return self._locked(lambda: answer(self._records()))

    def records(self) -> dict[int, Any]:
        """pid -> held record, a copy: iterating it never races a bind."""
        return self._locked(lambda: dict(self._records()))

    def get(self, pid: int):
        return self._locked(lambda: self._records().get(pid))

    def holds(self, pid: int) -> bool:
        return self._locked(lambda: pid in self._records())

    def current(self, h) -> bool:
        """Whether ``h`` is still the record held at its pid (not released, replaced or bound again)."""
        return self._locked(lambda: self._records().get(h.binding.pid) is h)

    def table(self) -> Table:
        return self._locked(self._table)

    def __len__(self) -> int:
        return len(self._records())  # a dict's len is one read: no lock needed for a gauge or a probe
