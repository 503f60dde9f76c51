"""A restarted daemon's first look at the state file's records.

Each record becomes a ``Held`` again, and each live worker is pinned again: its
pidfd first, then the start time and the pidfd inode the file kept (an older
record without the inode gets it from now on). What the daemon then does with
them (drop the gone, undo the in-flight, release what is no worker) is the
``Daemon``'s ``restore``.
"""

from __future__ import annotations

import dataclasses
import time

import structlog

from ...discovery.gather.identity import pin_identity
from ...errors import ProcessGone
from ..state.staterecord import IN_FLIGHT, binding_from_json
from ..watch.held import Held

__all__ = ["load_records"]

log = structlog.get_logger("ascendbind.daemon")


def load_records(raws, proc_root: str) -> tuple[list[Held], frozenset[int], set[int], int]:
    """(the state file's records, the pids still alive, those a killed daemon left in
    flight, how many entries were malformed); each live one pinned again: its pidfd
    first, then the start time and the pidfd inode the file kept."""
    records: list[Held] = []
    live: set[int] = set()
    flying: set[int] = set()
    bad = 0
    for raw in raws:
        try:
            b = binding_from_json(raw)
        except (KeyError, ValueError, TypeError) as exc:
            bad += 1
            log.error("state entry skipped", error=f"{type(exc).__name__}: {exc}")
            continue
        h = Held.from_state(b, raw, time.time())
        if raw.get(IN_FLIGHT) is True:
            flying.add(b.pid)
        try:
            h.pin = pin_identity(b.pid, b.start_time, b.pidfd_ino, proc_root)
            live.add(b.pid)
            if b.pidfd_ino is None and h.pin is not None and h.pin.ino is not None:
                h.binding = dataclasses.replace(b, pidfd_ino=h.pin.ino)  # an older record: kept from now on
        except ProcessGone:
            pass
        records.append(h)
    return records, frozenset(live), flying, bad
