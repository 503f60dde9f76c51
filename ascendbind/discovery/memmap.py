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

A region of numa_maps (``numa_maps.NumaRegion``, keyed by the same start
address) says how many of a mapping's pages are anonymous and on which node:
``move_ranges`` keeps the private mappings with anonymous pages off the target
node, so a move walks only those, however large the rest of the address space.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ParseError
from .numa_maps import NumaRegion

__all__ = ["Vma", "MoveRange", "parse_maps", "move_ranges", "movable_pages", "KERNEL_MAPPINGS",
           "PM_PRESENT", "PM_SWAPPED", "PM_FILE", "PM_EXCLUSIVE"]

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


@dataclass(frozen=True)
class MoveRange:
    """A private mapping to walk: [start, end) in pages of ``page_size`` bytes, with its
    anonymous bytes (``private_bytes``) and the part of them off the target node."""

    start: int
    end: int
    page_size: int
    private_bytes: int
    remote_bytes: int


def parse_maps(text: str, source: str = "maps") -> tuple[Vma, ...]:
    """The mappings of a ``/proc/<pid>/maps`` text, in its (address) order.

    ParseError (naming ``source`` and the line) for a line whose range or
    permissions do not read as the kernel prints them."""
    out: list[Vma] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
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
        out.append(Vma(start, end, perms[3] == "s", parts[5].strip() if len(parts) > 5 else ""))
    return tuple(out)


def move_ranges(vmas: Iterable[Vma], regions: Iterable[NumaRegion], node: int) -> tuple[MoveRange, ...]:
    """The private mappings holding anonymous pages off ``node``, with their sizes.

    A region without a mapping of the same start (the address space changed between
    the two reads) is left for the next move; so is a shared or kernel mapping."""
    by_start = {r.start: r for r in regions}
    out = []
    for v in vmas:
        r = by_start.get(v.start)
        if r is None or v.shared or v.path in KERNEL_MAPPINGS:
            continue
        private = r.private_pages()
        page = r.page_kib * 1024
        remote = sum(c for n, c in private.items() if n != node) * page
        if remote:
            out.append(MoveRange(v.start, v.end, page, sum(private.values()) * page, remote))
    return tuple(out)


def movable_pages(entries: Sequence[int], first: int, step: int, stride: int = 1) -> list[int]:
    """Addresses of the movable pages among ``entries`` (pagemap entries of consecutive
    base pages from address ``first``): every ``stride``-th entry is one page of
    ``step`` bytes (a huge page's first base page stands for all of it)."""
    mask, want = _MASK, _MOVABLE
    return [first + i * step for i, e in enumerate(entries[::stride]) if e & mask == want]
