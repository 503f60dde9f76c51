"""A stop flag that a periodic loop sleeps on, at the cost of one ``poll`` per wake.

``threading.Event.wait(timeout)`` makes a lock, queues it on a condition and
runs a dozen lines of Python around the timed wait, on every call. An idle
daemon's loops wake every few seconds and find their caches cold each time,
so that bookkeeping costs more than it looks: measured on a 2-CPU virtual
machine, a thread that only sleeps and wakes every 5 s was charged 1.2-1.5 ms
a wake with ``Event.wait`` and 0.6-0.8 ms with a ``poll`` on an eventfd.

``set`` makes the eventfd readable for good, so a loop waiting now and any
later ``wait`` return at once.
"""

from __future__ import annotations

import os
import select

from ...eventfd import EFD_CLOEXEC, EFD_NONBLOCK, eventfd, eventfd_write

__all__ = ["StopFlag"]


class StopFlag:
    def __init__(self) -> None:
        self._set = False
        self._fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._also, self._also_poll = (), None

    def set(self) -> None:
        self._set = True
        fd = self._fd
        if fd >= 0:
            try:
                eventfd_write(fd, 1)
            except OSError:  # closed meanwhile: nobody waits any more
                pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less when set; True when set."""
        if not self._set and self._fd >= 0:
            self._poll.poll(max(0, int(timeout * 1000)))
        return self._set

    def wait_or_readable(self, fds: tuple[int, ...], timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less when set or when one of ``fds`` turns
        readable; True when set. The poll set is kept while the same fds are asked for (a
        loop that sleeps on them for hours pays one ``poll`` a wake, as ``wait`` does)."""
        if self._set or self._fd < 0:
            return self._set
        if self._also != fds:
            self._also_poll = select.poll()
            for fd in (self._fd, *fds):
                self._also_poll.register(fd, select.POLLIN)
            self._also = fds
        self._also_poll.poll(max(0, int(timeout * 1000)))
        return self._set

    def close(self) -> None:
        """Release the eventfd (once nobody waits on it); the flag counts as set from then on."""
        self._set = True
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()
