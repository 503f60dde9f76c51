"""A stand-in inference worker, shaped like a vllm-ascend one, for bench/effect.py.

    python bench/stand_in.py [--helpers 4] [--work 100] [--release-every 8]

Threads, named as the real ones are (comm via prctl(PR_SET_NAME)):

* the main thread (``stand_in_main``) issues steps: it writes one byte to the
  ``acl_thread``'s pipe, then blocks on the reply pipe; the time from the write
  to the reply is one step's latency (``time.perf_counter_ns``);
* ``acl_thread`` waits on its pipe, does ``--work`` iterations of arithmetic
  (a few microseconds), pokes ``release_thread`` every ``--release-every``
  steps (0: never), and replies;
* ``release_thread`` waits on its pipe and does light work per poke;
* ``--helpers`` threads ``worker_h<i>`` wake every millisecond for light work
  (role main: they share the main CPUs when bound).

The waits are ``os.read`` on pipes and ``time.sleep``, which release the GIL, so
a step's latency is two thread wake-ups plus the work: what it measures is the
scheduler (where and how soon a woken thread runs), not an NPU.

Driven over stdin/stdout, one command a line:

    (start)          -> ``ready {"pid": .., "main": tid, "acl": tid, "release": tid, "helpers": [..]}``
    warm N           run N steps with the helpers on, discard them -> ``ok``
    run SECONDS PATH run steps for SECONDS, write the latencies (int64 ns,
                     native order) to PATH -> ``done STEPS WALL_NS``
    quit             exit

Between commands every thread is parked (blocked in a read or a wait), so the
per-thread counters the parent reads before and after ``run`` cover the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from array import array

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from threadname import name_self  # noqa: E402


def work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


class StandIn:
    SYNC = b"s"   # release pipe: "everything before me is handled"
    POKE = b"p"

    def __init__(self, helpers: int, work_n: int, release_every: int) -> None:
        self.work_n = work_n
        self.release_every = max(0, release_every)  # 0: never
        self.req_r, self.req_w = os.pipe()
        self.resp_r, self.resp_w = os.pipe()
        self.rel_r, self.rel_w = os.pipe()
        os.set_blocking(self.rel_w, False)  # acl never waits for the release thread
        self.synced = threading.Semaphore(0)
        self.gate = threading.Event()       # set while helpers should work
        self.parked = threading.Semaphore(0)
        self.tids: dict[str, object] = {}
        started = threading.Semaphore(0)
        self.n_helpers = helpers
        self.threads = [threading.Thread(target=self._acl, args=(started,), daemon=True),
                        threading.Thread(target=self._release, args=(started,), daemon=True)]
        self.threads += [threading.Thread(target=self._helper, args=(i, started), daemon=True)
                         for i in range(helpers)]
        for t in self.threads:
            t.start()
        for _ in self.threads:
            started.acquire()

    def _acl(self, started) -> None:
        name_self("acl_thread")
        self.tids["acl"] = threading.get_native_id()
        started.release()
        n, every, step = self.work_n, self.release_every, 0
        while True:
            if os.read(self.req_r, 1) == b"":
                return
            work(n)
            step += 1
            if every and step % every == 0:
                try:
                    os.write(self.rel_w, self.POKE)
                except BlockingIOError:
                    pass
            os.write(self.resp_w, b"r")

    def _release(self, started) -> None:
        name_self("release_thread")
        self.tids["release"] = threading.get_native_id()
        started.release()
        while True:
            data = os.read(self.rel_r, 64)
            if not data:
                return
            for b in data:
                if b == self.SYNC[0]:
                    self.synced.release()
                else:
                    work(self.work_n // 2)

    def _helper(self, i: int, started) -> None:
        name_self(f"worker_h{i}")
        self.tids.setdefault("helpers", []).append(threading.get_native_id())  # type: ignore[union-attr]
        started.release()
        while True:
            self.gate.wait()
            while self.gate.is_set():
                time.sleep(0.001)
                work(self.work_n // 4)
            self.parked.release()

    def steps(self, *, count: int = 0, seconds: float = 0.0) -> tuple[array, int]:
        """Run ``count`` steps, or steps for ``seconds``; the latencies (ns) and the wall time (ns)."""
        samples = array("q")
        clock = time.perf_counter_ns
        req, resp = self.req_w, self.resp_r
        self.gate.set()
        t_start = clock()
        deadline = t_start + int(seconds * 1e9)
        i = 0
        while (i < count) if count else (clock() < deadline):
            t0 = clock()
            os.write(req, b"x")
            os.read(resp, 1)
            samples.append(clock() - t0)
            i += 1
        wall = clock() - t_start
        self.quiesce()
        return samples, wall

    def quiesce(self) -> None:
        """Park every thread: helpers back at the gate, the release pipe drained."""
        self.gate.clear()
        for _ in range(self.n_helpers):
            self.parked.acquire()
        os.set_blocking(self.rel_w, True)
        os.write(self.rel_w, self.SYNC)
        os.set_blocking(self.rel_w, False)
        self.synced.acquire()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--helpers", type=int, default=4)
    ap.add_argument("--work", type=int, default=100, help="arithmetic iterations per step")
    ap.add_argument("--release-every", type=int, default=8, help="steps between release pokes (0: never)")
    args = ap.parse_args(argv)
    name_self("stand_in_main")
    w = StandIn(args.helpers, args.work, args.release_every)
    out = sys.stdout
    ids = {"pid": os.getpid(), "main": threading.get_native_id(), **w.tids}
    out.write("ready " + json.dumps(ids) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "warm":
            w.steps(count=int(rest[0]))
            out.write("ok\n")
        elif cmd == "run":
            samples, wall = w.steps(seconds=float(rest[0]))
            fd = os.open(rest[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as fh:
                samples.tofile(fh)
            out.write(f"done {len(samples)} {wall}\n")
        elif cmd == "quit":
            break
        else:
            out.write("?\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
