"""What the code under test really reads: the files it opens and the directories it
lists, from the interpreter's own audit events (``open``, ``os.listdir``), its
``move_pages(2)`` calls (``ascendbind.move_pages``, raised before each), and the read
system calls of a thread as the kernel counts them (``/proc/thread-self/io``),
with nothing replaced."""

from __future__ import annotations

import re
import sys

__all__ = ["Reads", "thread_reads"]

_events: list[tuple[str, object]] | None = None


def _hook(event: str, args: tuple) -> None:
    if _events is not None and event in ("open", "os.listdir"):
        _events.append((event, args[0] if args else None))
    elif _events is not None and event == "ascendbind.move_pages":
        _events.append((event, args))


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

    def move_pages(self) -> list[tuple[int, int, int]]:
        """(pid, pages, target node or -1 for a query) of each move_pages(2) call."""
        return [a for ev, a in self.events if ev == "ascendbind.move_pages"]

    def opened(self, suffix: str) -> int:
        return sum(1 for ev, p in self.events if ev == "open" and isinstance(p, str) and p.endswith(suffix))


def thread_reads() -> int:
    """Read system calls (read, pread64, readv, ...) the calling thread has made, as the
    kernel counts them (``syscr``); reading the count is one more."""
    with open("/proc/thread-self/io") as fh:
        for line in fh:
            if line.startswith("syscr:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/thread-self/io has no syscr line")
