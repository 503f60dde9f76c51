"""Worker threads shared fairly between the peers of a listener.

A plain thread pool serves requests first come, first served: a user who keeps
``workers`` slow requests queued (a worker whose files are slow to read, a
flood of binds) makes every other user's request, ``/healthz`` included, wait
behind all of them. Here every peer (the uid on the API socket, the address on
the metrics port) has its own queue, and:

* at most ``per_key`` of one peer's requests run at once, so one peer holds at
  most that many of the threads however many requests it sends; the rest of
  its requests wait in its own queue, never in front of anyone else's;
* a free thread takes the next request of the peer whose last turn is the
  oldest (round robin over the peers with work), so a peer with one request is
  served as soon as a thread is free, whatever another peer has queued.

A peer's queue is bounded by its connection cap (the listener admits no more),
so nothing here grows without bound. The threads are daemon threads and nothing
joins them at exit: a request stuck in the kernel (a read the caller's own
filesystem never answers) must not keep the process from exiting on SIGTERM.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable

from ..runtime.threadname import name_os_thread

__all__ = ["FairPool"]


class FairPool:
    """``threads`` threads; a peer (``key``) has at most ``per_key`` of them at once."""

    def __init__(self, threads: int, per_key: int, *, name: str) -> None:
        if threads < 1 or per_key < 1:
            raise ValueError(f"FairPool needs threads >= 1 and per_key >= 1, got {threads}, {per_key}")
        self.per_key = per_key
        self._cond = threading.Condition()
        self._queues: dict[Hashable, collections.deque] = {}
        self._running: collections.Counter = collections.Counter()
        # when each peer with queued or running work last got a thread (0: not yet)
        self._last_turn: dict[Hashable, int] = {}
        self._turns = 0
        self._stopped = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, key: Hashable, fn: Callable[..., object], *args) -> None:
        """Queue ``fn(*args)`` for ``key``; RuntimeError once stopped."""
        with self._cond:
            if self._stopped:
                raise RuntimeError("pool stopped")
            self._queues.setdefault(key, collections.deque()).append((fn, args))
            self._last_turn.setdefault(key, 0)
            self._cond.notify()

    def running(self, key: Hashable) -> int:
        with self._cond:
            return self._running[key]

    def queued(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def stop(self) -> list[tuple[Callable[..., object], tuple]]:
        """Refuse new work, wake idle threads so they end, and hand back what was still
        queued (the caller closes those connections). Running calls are not waited for."""
        with self._cond:
            self._stopped = True
            left = [item for q in self._queues.values() for item in q]
            self._queues.clear()
            self._cond.notify_all()
        return left

    def _next(self):
        """(key, call) to run next (under the condition), or None when no peer may run now:
        of the peers below their share, the one whose last turn is oldest. The peers with
        work are at most the listener's connections, so a scan is cheap."""
        ready = [k for k in self._queues if self._running[k] < self.per_key]
        if not ready:
            return None
        key = min(ready, key=self._last_turn.__getitem__)
        q = self._queues[key]
        item = q.popleft()
        if not q:
            del self._queues[key]
        self._running[key] += 1
        self._turns += 1
        self._last_turn[key] = self._turns
        return key, item

    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    picked = self._next()
                    if picked is not None:
                        break
                    self._cond.wait()
            key, (fn, args) = picked
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the listener's work function answers its own errors
                pass
            finally:
                with self._cond:
                    self._running[key] -= 1
                    if self._running[key] <= 0:
                        del self._running[key]
                        if key not in self._queues:
                            del self._last_turn[key]
                    # this peer may run its next request now, on any thread
                    self._cond.notify_all()
