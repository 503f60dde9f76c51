"""What the code under test really reads: the files it opens and the directories it
lists, from the interpreter's own audit events (``open``, ``os.listdir``), with
nothing replaced."""

from __future__ import annotations

import re
import sys

__all__ = ["Reads"]

_events: list[tuple[str, object]] | None = None


def _hook(event: str, args: tuple) -> None:
    if _events is not None and event in ("open", "os.listdir"):
        _events.append((event, args[0] if args else None))


sys.addaudithook(_hook)


class Reads:
    """The files opened and directories listed while the block runs (audit events)."""

    def __enter__(self) -> Reads:
        global _events
        _events = self.events = []
        return self

    def __exit__(self, *exc) -> None:
        global _events
        _events = None

    def task_listings(self, pid: int) -> int:
        """Listings of /proc/<pid>/task: by path, or through an opened ``task`` directory."""
        by_path = sum(1 for ev, p in self.events if ev == "os.listdir" and isinstance(p, str)
                      and p.rstrip("/").endswith(f"/{pid}/task"))
        by_fd = sum(1 for ev, p in self.events if ev == "open" and p == "task")
        return by_path + by_fd

    def comm_reads(self, tids) -> dict[int, int]:
        """tid -> how often its comm was opened (relative or absolute path)."""
        pat = re.compile(r"(?:^|/)(\d+)/comm$")
        out = {t: 0 for t in tids}
        for ev, p in self.events:
            m = pat.search(p) if ev == "open" and isinstance(p, str) else None
            if m and int(m.group(1)) in out:
                out[int(m.group(1))] += 1
        return out

    def opened(self, suffix: str) -> int:
        return sum(1 for ev, p in self.events if ev == "open" and isinstance(p, str) and p.endswith(suffix))
