"""An eventfd (eventfd(2)): a kernel counter behind a file descriptor, readable while non-zero.

The daemon sleeps on them with ``poll`` (the stop flag, the reconcile loop's poke) and
compares a pidfd's inode with one to learn whether pidfds carry their own (pidfs).
``os.eventfd`` arrived in Python 3.10; the hosts' own Python may be 3.9 (openEuler
22.03, Debian 11), so there the descriptor comes from glibc's ``eventfd()`` (present
since glibc 2.8) through ctypes. Reads and writes are the kernel's 8-byte counter in
native byte order either way, which is all ``os.eventfd_read``/``eventfd_write`` do.

A non-blocking read of a zero counter raises ``BlockingIOError`` (EAGAIN), as
``os.eventfd_read`` does.
"""

from __future__ import annotations

import os
import sys

__all__ = ["EFD_CLOEXEC", "EFD_NONBLOCK", "eventfd", "eventfd_read", "eventfd_write", "libc_eventfd"]

# <sys/eventfd.h>: the flags are O_CLOEXEC and O_NONBLOCK on every Linux architecture
EFD_CLOEXEC = getattr(os, "EFD_CLOEXEC", os.O_CLOEXEC)
EFD_NONBLOCK = getattr(os, "EFD_NONBLOCK", os.O_NONBLOCK)


def libc_eventfd(initval: int, flags: int) -> int:
    """glibc's eventfd(), what ``os.eventfd`` calls; OSError with the errno it sets."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.eventfd(ctypes.c_uint(initval), ctypes.c_int(flags))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def eventfd(initval: int, flags: int = EFD_CLOEXEC) -> int:
    """A new eventfd holding ``initval``; OSError as the kernel refuses (EMFILE, ENFILE...)."""
    stdlib = getattr(os, "eventfd", None)
    return stdlib(initval, flags) if stdlib is not None else libc_eventfd(initval, flags)


def eventfd_write(fd: int, value: int) -> None:
    """Add ``value`` to the counter (wakes every poller)."""
    os.write(fd, value.to_bytes(8, sys.byteorder))


def eventfd_read(fd: int) -> int:
    """Take the counter and reset it to zero."""
    return int.from_bytes(os.read(fd, 8), sys.byteorder)
