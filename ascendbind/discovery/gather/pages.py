"""A worker's private memory, read for the memory step: which ranges to walk, and
their pagemap entries.

``read_move_ranges`` reads ``/proc/<pid>/maps`` (cheap: no page walk) and
``numa_maps`` (a page walk, about 5 ms per GiB of 4 KiB pages) and keeps the
private mappings with anonymous pages off the target node (memmap.py), in one
pass over each file. A worker of more than ``COARSE_MAPPINGS`` mappings is read
from ``maps`` alone: numa_maps would cost a page walk and a line per mapping,
and a move then asks the kernel where each page of its writable anonymous
mappings is instead.
``open_pagemap`` opens ``/proc/<pid>/pagemap`` through the process's pinned
``/proc/<pid>`` directory, so its reads describe the process the move was
started for and fail (ESRCH, or nothing read) once that process is gone, never a
newcomer under a recycled pid. Reading another user's pagemap needs
CAP_SYS_PTRACE (the daemon has it); its page frame numbers need CAP_SYS_ADMIN
and are not used.

Only a live host has these files: a snapshot records no process memory, and
both functions then say so (``DiscoveryError`` / None).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..parse.memmap import MoveRange, move_ranges, writable_anonymous
from ..parse.numa_maps import NumaResidency, scan_numa_maps
from ..read.sources import HostSource
from .worker import NUMA_MAPS_LIMIT, check_start_time, read_memory_file

__all__ = ["read_move_ranges", "open_pagemap", "PageMap", "MoveRanges", "BASE_PAGE", "COARSE_MAPPINGS"]

BASE_PAGE = os.sysconf("SC_PAGE_SIZE")
COARSE_MAPPINGS = 2048
_ENTRY = 8  # bytes per pagemap entry


@dataclass(frozen=True)
class MoveRanges:
    """What a move to one node would walk: the mappings numa_maps found with anonymous
    pages off the node (``ranges``, and the worker's ``residency`` they were read from),
    or, for a worker of many mappings, its writable anonymous ones (``spans``: (start,
    end, mappings) each, neighbours in runs: memmap.py's ``writable_anonymous``;
    ``residency`` None); and how many mappings the worker has."""

    ranges: tuple[MoveRange, ...]
    residency: NumaResidency | None
    mappings: int = 0
    spans: tuple[tuple[int, int, int], ...] | None = None

    @property
    def coarse(self) -> bool:
        return self.spans is not None

    @property
    def remote_bytes(self) -> int:
        """numa_maps' bytes off the node (0 when it was not read: not known before the walk)."""
        return sum(r.remote_bytes for r in self.ranges)


def read_move_ranges(source: HostSource, pid: int, node: int, *, start_time: int | None = None,
                     limit: int = NUMA_MAPS_LIMIT, coarse_over: int | None = COARSE_MAPPINGS) -> MoveRanges:
    """The private ranges of ``pid`` with anonymous pages off ``node``; past ``coarse_over``
    mappings (None: never), its writable anonymous ones.

    DiscoveryError when a file cannot be read (the process is gone, or not
    readable) or is longer than ``limit`` (code ``too_large``); ParseError when
    one is malformed; ProcessGone ``pid_recycled`` when ``start_time`` no longer
    names the process once both are read."""
    maps, maps_path = read_memory_file(source, pid, "maps", limit)
    mappings = maps.count("\n")
    if coarse_over is not None and mappings > coarse_over:
        found = MoveRanges((), None, mappings, tuple(writable_anonymous(maps)))
    else:
        numa, numa_path = read_memory_file(source, pid, "numa_maps", limit)
        scan = scan_numa_maps(numa, numa_path, node=node)
        found = MoveRanges(move_ranges(maps, scan.off_node, maps_path), scan.residency, scan.lines)
    if start_time is not None:
        check_start_time(source, pid, start_time, "its memory map")
    return found


class PageMap:
    """``/proc/<pid>/pagemap`` held open: ``entries(addr, n)`` are the 64-bit entries of
    the ``n`` base pages from ``addr`` (fewer, or none, once the process is gone);
    ``read`` the same as bytes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self, addr: int, count: int) -> bytes:
        """The entries as the kernel wrote them, 8 bytes each (in whole entries; fewer, or
        none, once the process is gone)."""
        try:
            raw = os.pread(self.fd, count * _ENTRY, (addr // BASE_PAGE) * _ENTRY)
        except OSError:
            return b""
        return raw[: len(raw) - len(raw) % _ENTRY]

    def entries(self, addr: int, count: int) -> memoryview:
        return memoryview(self.read(addr, count)).cast("Q")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PageMap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_pagemap(source: HostSource, pid: int) -> PageMap | None:
    """``pid``'s pagemap, opened through its pinned /proc directory; None when the source
    is not a live host, the process is gone, or the file may not be read."""
    opener = getattr(source, "open_process", None)
    proc = opener(str(int(pid))) if opener is not None else None
    if proc is None:
        return None
    try:
        fd = os.open("pagemap", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc.fd)
    except OSError:
        return None
    finally:
        proc.close()
    return PageMap(fd)
