"""Start tests/memworker.py (a worker holding real private, shared and huge-page memory)
and talk to it; always reaped.

    with mem_worker(private_mib=64, shared=[("/dev/shm/seg", 16)], membind=1) as w:
        w.pid, w.regions["private"][0]["start"]
        w.steps(4)     # the worker's own step durations (seconds) over its private memory
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence

from tests.workers import PipeChild, reap

__all__ = ["MemWorker", "mem_worker", "MEMWORKER"]

MEMWORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memworker.py")


class MemWorker(PipeChild):
    def __init__(self, proc: subprocess.Popen, ready: dict) -> None:
        super().__init__(proc)
        self.regions: dict[str, list[dict]] = ready["regions"]

    def steps(self, n: int) -> list[float]:
        """Durations of ``n`` steps of work over its private memory (see memworker.py)."""
        reply = self._ask(f"steps {n}")
        return json.loads(reply.partition(" ")[2])

    def touch(self) -> None:
        self._ask("touch")

    def alloc(self, mib: int) -> dict:
        """Map and touch ``mib`` more MiB of private memory; returns the new region."""
        region = json.loads(self._ask(f"alloc {mib}").partition(" ")[2])
        self.regions.setdefault("private", []).append(region)
        return region



@contextlib.contextmanager
def mem_worker(*, private_mib: int = 0, shared: Sequence[tuple[str, int]] = (), hugetlb_private: int = 0,
               hugetlb_shared: Sequence[tuple[str, int]] = (), threads: Sequence[str] = (),
               membind: int | None = None, private_pages: int = 0, tiny: int = 0,
               no_thp: bool = False) -> Iterator[MemWorker]:
    """A memory worker (see memworker.py); ``membind``: run it under ``numactl --membind``;
    ``private_pages``: base pages more in one private mapping; ``tiny``: one-page private
    mappings, each apart from the next; ``no_thp``: its private mappings in base pages only."""
    # -S: the worker is stdlib only, and the site packages' import costs seconds in a NUMA guest
    argv = [sys.executable, "-S", MEMWORKER, "--private-mib", str(private_mib),
            "--hugetlb-private", str(hugetlb_private), "--private-pages", str(private_pages), "--tiny", str(tiny),
            *(["--no-thp"] if no_thp else [])]
    for path, mib in shared:
        argv += ["--shared", f"{path}:{mib}"]
    for path, pages in hugetlb_shared:
        argv += ["--hugetlb-shared", f"{path}:{pages}"]
    if threads:
        argv += ["--threads", ",".join(threads)]
    if membind is not None:
        numactl = shutil.which("numactl")
        if numactl is None:
            raise RuntimeError("numactl is not installed (Debian package numactl)")
        argv = [numactl, f"--membind={membind}", *argv]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        assert proc.stdout
        line = proc.stdout.readline()
        if not line.startswith("ready "):
            raise RuntimeError(f"memory worker did not start: {line!r}")
        worker = MemWorker(proc, json.loads(line.partition(" ")[2]))
        yield worker
    finally:
        if worker is not None:
            worker.close()
        else:
            reap(proc)
