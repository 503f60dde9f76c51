"""``/proc/<pid>/maps`` and ``/proc/<pid>/pagemap`` -> which pages are a process's own. Pure.

The memory step moves a worker's *private* pages only. Two kernel views decide
which those are, and both are read here as values:

* ``maps`` lists the mappings (VMAs): ``start-end perms offset dev inode
  [path]``. The fourth letter of ``perms`` is ``s`` for a ``MAP_SHARED``
  mapping (``/dev/shm``, memfd, System V and hugetlbfs segments, shared
  files), ``p`` for a private one. A shared mapping holds no private page and
  is never walked; neither are the kernel's own (``[vdso]``, ``[vvar]``,
  ``[vsyscall]``, arm64's ``[vectors]``).
* ``pagemap`` holds one 64-bit entry per virtual base page (4 KiB, or 64 KiB
  on some arm64 kernels; a huge page has one entry per base page it spans):
  bit 63 *present*, bit 62 *swapped*, bit 61 *file page or shared anonymous*,
  bit 56 *exclusively mapped* (by this process alone). A page is movable when it is present,
  anonymous and exclusive: a private mapping of a file also holds page-cache
  pages it never wrote (bit 61), and an anonymous page still shared with a
  parent or child after ``fork`` is not exclusive. Such pages stay.

The kernel checks exclusivity again when it moves a page (``move_pages(2)``
without ``MPOL_MF_MOVE_ALL`` refuses a page mapped by several processes with
``EACCES``), so a page shared between the read and the move is still left alone.

numa_maps says how many of a mapping's pages are anonymous and on which node
(``numa_maps.scan_numa_maps``: the mappings with anonymous pages off the target
node, by start address as printed); ``move_ranges`` reads from ``maps`` the
private mappings among those, so a move walks only them, however large the rest
of the address space. A line of ``maps`` that starts no such mapping costs a
look-up: a worker of tens of thousands of mappings is read in one pass of small
steps, not one parse per line.

numa_maps costs the kernel a page-table walk and a formatted line per mapping:
for a worker of one-page mappings, about what moving its pages costs. A worker
of many mappings (discovery/gather/pages.py) is therefore read from ``maps`` alone:
``writable_anonymous`` finds its writable private anonymous mappings (heap,
stacks, allocations) in one regular-expression scan, neighbours side by side as
runs, and where each of their
movable pages is gets asked of the kernel (``move_pages(2)`` with no nodes, a
chunk of pages a call). Its file-backed private mappings (a library's written
data; private huge pages, whose page size ``maps`` does not print) then stay
where they are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add
from typing import NamedTuple

from ...errors import ParseError
from .numa_maps import OffNode, text_lines

__all__ = ["Vma", "MoveRange", "parse_maps", "move_ranges", "writable_anonymous", "RUN_BLOCK", "movable_pages",
           "KERNEL_MAPPINGS", "PM_PRESENT", "PM_SWAPPED", "PM_FILE", "PM_EXCLUSIVE"]

PM_PRESENT = 1 << 63
PM_SWAPPED = 1 << 62
PM_FILE = 1 << 61  # a file page, or a shared anonymous (shmem) page
PM_EXCLUSIVE = 1 << 56  # mapped by this process only (Linux 4.2+)
_MASK = PM_PRESENT | PM_FILE | PM_EXCLUSIVE
_MOVABLE = PM_PRESENT | PM_EXCLUSIVE

KERNEL_MAPPINGS = frozenset(("[vdso]", "[vvar]", "[vvar_vclock]", "[vsyscall]", "[vectors]", "[sigpage]", "[uprobes]"))


@dataclass(frozen=True)
class Vma:
    """One mapping of ``maps``: [start, end), shared or private, and its path ('' when anonymous)."""

    start: int
    end: int
    shared: bool
    path: str = ""


class MoveRange(NamedTuple):
    """A private mapping to walk: [start, end) in pages of ``page_size`` bytes, with its
    anonymous bytes (``private_bytes``) and the part of them off the target node; ``ask``:
    where its pages are is to be asked first (numa_maps saw some on the node, or was not
    read); ``mappings``: how many mappings it spans (several, for neighbours walked as
    one). A tuple: a worker of many mappings makes many."""

    start: int
    end: int
    page_size: int
    private_bytes: int
    remote_bytes: int
    ask: bool = False
    mappings: int = 1


def _row(line: str, lineno: int, source: str) -> tuple[int, int, bool, str]:
    """(start, end, shared, path) of one row of ``maps``; ParseError when its range or
    permissions do not read as the kernel prints them."""
    # the path is the sixth field and may itself hold spaces
    parts = line.split(None, 5)
    if len(parts) < 5:
        raise ParseError(source, "row has fewer than five fields", line=lineno, text=line)
    lo, dash, hi = parts[0].partition("-")
    perms = parts[1]
    try:
        start, end = int(lo, 16), int(hi, 16)
    except ValueError:
        raise ParseError(source, f"bad address range {parts[0]!r}", line=lineno, text=line) from None
    if not dash or end < start or len(perms) != 4 or perms[3] not in "ps":
        raise ParseError(source, f"bad range or permissions {parts[0]} {perms}", line=lineno, text=line)
    return start, end, perms[3] == "s", parts[5].strip() if len(parts) > 5 else ""


def parse_maps(text: str, source: str = "maps") -> tuple[Vma, ...]:
    """The mappings of a ``/proc/<pid>/maps`` text, in its (address) order.

    ParseError (naming ``source`` and the line) for a line whose range or
    permissions do not read as the kernel prints them."""
    return tuple(Vma(*_row(line, lineno, source)) for lineno, line in enumerate(text_lines(text), start=1)
                 if line.strip())


def move_ranges(maps: str, off_node: Mapping[str, OffNode], source: str = "maps") -> tuple[MoveRange, ...]:
    """The private mappings of the ``maps`` text that numa_maps found holding anonymous
    pages off the node (``off_node``, by start address as both files print it), in
    address order, with their sizes.

    A mapping of ``off_node`` that ``maps`` does not start (the address space changed
    between the two reads) is left for the next move; so is a shared or kernel
    mapping. Only the rows that start one of ``off_node`` are read whole (ParseError
    for such a row that does not read as the kernel prints it)."""
    if not off_node:
        return ()
    out = []
    get = off_node.get
    for lineno, line in enumerate(text_lines(maps), start=1):
        r = get(line[:line.find("-")])
        if r is None:
            continue
        start, end, shared, path = _row(line, lineno, source)
        if not shared and path not in KERNEL_MAPPINGS:
            out.append(MoveRange(start, end, r.page_size, r.private_bytes, r.remote_bytes,
                                 r.remote_bytes != r.private_bytes))
    return tuple(out)


# a writable private anonymous mapping: no file (device 00:00, inode 0), no path or a
# bracketed name ([heap], [stack], [anon:<name>]); the kernel's own are never writable.
# The rest of its line after the range:
_ANON_TAIL = r" .w.p [0-9a-f]+ 00:00 0 *(?:\[[^\n]*)?\n"
# A run: such lines one after another whose bounds differ in the last five hex digits
# alone (``p``: the digits before them), so all lie in one 1 MiB-aligned block: its
# first start, the repeats (each the end of one line, its tail, the start of the next)
# and its last end; else one such line on its own (``a``-``b``)
_WRITABLE_ANON_RUN = re.compile(
    r"^(?:(?P<p>[0-9a-f]+?)(?P<s>[0-9a-f]{5})-"
    r"(?P<more>(?:(?P=p)[0-9a-f]{5}" + _ANON_TAIL + r"(?P=p)[0-9a-f]{5}-)*)"
    r"(?P=p)(?P<e>[0-9a-f]{5})" + _ANON_TAIL +
    r"|(?P<a>[0-9a-f]+)-(?P<b>[0-9a-f]+)" + _ANON_TAIL + r")", re.M)
RUN_BLOCK = 1 << 20  # the block a run lies in (five hex digits)


def writable_anonymous(maps: str) -> list[tuple[int, int, int]]:
    """(start, end, mappings) of the writable private anonymous mappings of a ``maps``
    text, in its (address) order: where a worker's heap, stacks and allocations are.
    Mappings listed one after another within one ``RUN_BLOCK``-aligned block come as one
    [start of the first, end of the last), with how many they are; any other as itself.

    A worker of tens of thousands of one-page mappings makes them side by side, a few
    hundred to the block: one scan of the text, with the runs told by comparing digits
    in the regular expression, leaves a few hundred bounds to convert, and every step
    after the scan is done in C. A row that does not read as the kernel prints it is
    not one of them."""
    if maps and not maps.endswith("\n"):
        maps += "\n"
    rows = _WRITABLE_ANON_RUN.findall(maps)
    if not rows:
        return []
    ps, ss, more, es, as_, bs = zip(*rows)
    # a run has p, s, e (a and b empty), a line on its own a and b (the others empty)
    starts = map(int, map(add, map(add, ps, ss), as_), repeat(16))
    ends = map(int, map(add, map(add, ps, es), bs), repeat(16))
    # each repeat holds one line's end: one newline
    counts = map(add, map(str.count, more, repeat("\n")), repeat(1))
    return list(zip(starts, ends, counts))


def movable_pages(entries: Sequence[int], first: int, step: int, stride: int = 1) -> list[int]:
    """Addresses of the movable pages among ``entries`` (pagemap entries of consecutive
    base pages from address ``first``): every ``stride``-th entry is one page of
    ``step`` bytes (a huge page's first base page stands for all of it)."""
    mask, want = _MASK, _MOVABLE
    return [first + i * step for i, e in enumerate(entries[::stride]) if e & mask == want]
