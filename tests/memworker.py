"""A worker that holds real memory of each kind, for the NUMA tests and the memory bench.

    python3 tests/memworker.py --private-mib 1024 --shared /dev/shm/seg:256 [--hugetlb-private 4]
                               [--hugetlb-shared /dev/hugepages/x:4] [--threads acl_thread,release_thread]
                               [--private-pages N] [--tiny N] [--no-thp]

It maps and touches, in this order: ``--private-mib`` MiB of anonymous private
memory (``MAP_PRIVATE | MAP_ANONYMOUS``), ``--private-pages N`` base pages more
in one such mapping, ``--tiny N`` private mappings of one base page each (one
region of 2N pages whose every other page is unmapped again, so that no two of
them are adjacent and the kernel keeps N mappings; ``--no-thp``: the private mappings,
the tiny ones included, in base pages only, ``MADV_NOHUGEPAGE``), each ``--shared PATH:MIB`` file
(created if absent, ``MAP_SHARED``: a ``/dev/shm`` segment several workers map),
``--hugetlb-private N`` 2 MiB huge pages (``MAP_PRIVATE | MAP_HUGETLB``) and each
``--hugetlb-shared PATH:N`` (a hugetlbfs file, ``MAP_SHARED``). Every page is
written once, so where it lives is decided by this process's memory policy when
it starts (run it under ``numactl --membind=N`` to put it all on node N). Then it
prints one line, ``ready <json>`` with the start address and length of each
region, and obeys one command per stdin line:

* ``steps N`` - N steps of work over its private memory (each step writes one
  byte in every page of a 64 MiB window, the window moving on each step) and
  prints ``steps <json>`` with the step durations in seconds: what a worker's
  own latency is while its pages move under it.
* ``touch`` - writes every private page again, prints ``ok``.
* ``alloc MIB`` - maps and touches MIB more of private memory (placed by the
  process's memory policy, like any new allocation), prints ``alloc <json>``
  with the new region.
* ``quit`` - exits.

Stdlib only: it runs in the guest kernel's root and under any interpreter.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import threading
import time

PAGE = mmap.PAGESIZE
HUGE = 2 << 20
MAP_HUGETLB = 0x40000
WINDOW = 64 << 20

libc = ctypes.CDLL(None, use_errno=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/, for threadname
from threadname import name_self  # noqa: E402


def address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def touch(m: mmap.mmap, start: int = 0, length: int | None = None, stride: int = PAGE, value: int = 1) -> None:
    """Write one byte in every ``stride`` bytes of ``m[start:start+length]``."""
    end = len(m) if length is None else min(len(m), start + length)
    view = memoryview(m)
    # one slice assignment per chunk: the loop runs in C, not a Python loop per page
    chunk = 16 << 20
    pattern = bytes([value]) * (chunk // stride)
    for off in range(start, end, chunk):
        n = min(chunk, end - off) // stride
        view[off:off + n * stride:stride] = pattern[:n]
    view.release()


def tiny_mappings(n: int, no_thp: bool = False) -> dict:
    """``n`` one-page private anonymous mappings, each written once, with a hole after
    each: {"start", "count", "stride"} (the first page's address, n, bytes between pages).

    The region is written before it is cut up: where the kernel allows transparent huge
    pages, each 2 MiB of it is faulted in as one, and the one-page mappings then map
    pieces of huge pages (half of each, the other half unmapped), which a move copies
    whole; ``no_thp`` (``MADV_NOHUGEPAGE`` first) makes them base pages of their own."""
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    base = libc.mmap(None, 2 * n * PAGE, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    if no_thp and libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(2 * n * PAGE), mmap.MADV_NOHUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise")
    # one byte in every other page, by one strided write done in C
    view = (ctypes.c_char * (2 * n * PAGE)).from_address(base)
    view[0:2 * n * PAGE:2 * PAGE] = b"\x01" * n
    for i in range(n):
        if libc.munmap(base + (2 * i + 1) * PAGE, PAGE) != 0:
            raise OSError(ctypes.get_errno(), "munmap")
    return {"start": base, "count": n, "stride": 2 * PAGE, "length": PAGE}


def map_file(path: str, size: int, huge: bool = False) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def spec(text: str) -> tuple[str, int]:
    path, _, n = text.rpartition(":")
    if not path or not n.isdigit():
        raise argparse.ArgumentTypeError(f"expected PATH:NUMBER, got {text!r}")
    return path, int(n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--private-mib", type=int, default=0)
    ap.add_argument("--shared", type=spec, action="append", default=[], metavar="PATH:MIB")
    ap.add_argument("--hugetlb-private", type=int, default=0, metavar="PAGES")
    ap.add_argument("--hugetlb-shared", type=spec, action="append", default=[], metavar="PATH:PAGES")
    ap.add_argument("--private-pages", type=int, default=0, metavar="PAGES")
    ap.add_argument("--tiny", type=int, default=0, metavar="MAPPINGS")
    ap.add_argument("--no-thp", action="store_true")
    ap.add_argument("--threads", default="", help="comma list of extra named threads (acl_thread, ...)")
    args = ap.parse_args()

    regions: dict[str, list] = {}
    keep: list[mmap.mmap] = []

    def note(kind: str, m: mmap.mmap, extra: dict | None = None) -> None:
        keep.append(m)
        regions.setdefault(kind, []).append({"start": address(m), "length": len(m), **(extra or {})})

    def private(size: int) -> mmap.mmap:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if args.no_thp:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        touch(m)
        return m

    if args.private_mib:
        m = private(args.private_mib << 20)
        note("private", m)
    if args.private_pages:
        m = private(args.private_pages * PAGE)
        note("private_pages", m)
    if args.tiny:
        regions["tiny"] = [tiny_mappings(args.tiny, args.no_thp)]
    for path, mib in args.shared:
        m = map_file(path, mib << 20)
        touch(m)
        note("shared", m, {"path": path})
    if args.hugetlb_private:
        m = mmap.mmap(-1, args.hugetlb_private * HUGE,
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
        touch(m, stride=HUGE)
        note("hugetlb_private", m)
    for path, pages in args.hugetlb_shared:
        m = map_file(path, pages * HUGE)
        touch(m, stride=HUGE)
        note("hugetlb_shared", m, {"path": path})

    stop = threading.Event()
    for name in filter(None, args.threads.split(",")):
        ready = threading.Event()

        def run(n: str = name, r: threading.Event = ready) -> None:
            name_self(n)
            r.set()
            stop.wait()

        threading.Thread(target=run, daemon=True).start()
        ready.wait()

    out = sys.stdout
    out.write("ready " + json.dumps({"pid": os.getpid(), "regions": regions}) + "\n")
    out.flush()
    private = keep[0] if args.private_mib else None
    window = 0
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "steps" and private is not None:
            times = []
            for i in range(int(arg or 1)):
                t0 = time.perf_counter()
                touch(private, window, WINDOW, value=(i & 0x7F) + 1)
                times.append(time.perf_counter() - t0)
                window = (window + WINDOW) % len(private)
            out.write("steps " + json.dumps(times) + "\n")
        elif cmd == "touch" and private is not None:
            touch(private)
            out.write("ok\n")
        elif cmd == "alloc" and arg.isdigit():
            m = mmap.mmap(-1, int(arg) << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            touch(m)
            note("private", m)
            out.write("alloc " + json.dumps(regions["private"][-1]) + "\n")
        elif cmd == "quit":
            break
        else:
            out.write("?\n")
        out.flush()
    stop.set()


if __name__ == "__main__":
    main()
