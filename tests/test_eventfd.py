"""The eventfd the daemon sleeps on, from the stdlib (3.10 on) and from glibc (3.9): one kernel object.

Runs on the host's Python and in the Python 3.9 root (tests/debian_roots.py), where
``eventfd`` takes the glibc path; here both paths are driven side by side and read back
from the kernel: the descriptor's inode is an eventfd, the flags are the ones asked for,
the counter adds and resets, and ``poll`` wakes on it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select

import pytest

from ascendbind.eventfd import EFD_CLOEXEC, EFD_NONBLOCK, eventfd, eventfd_read, eventfd_write, libc_eventfd

MAKERS = [pytest.param(eventfd, id="eventfd"), pytest.param(libc_eventfd, id="glibc")]


@pytest.fixture
def fds():
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


@pytest.mark.parametrize("make", MAKERS)
def test_the_descriptor_is_an_eventfd_with_the_flags_asked_for(make, fds):
    fd = make(0, EFD_CLOEXEC | EFD_NONBLOCK)
    fds.append(fd)
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
    blocking = make(0, EFD_CLOEXEC)
    fds.append(blocking)
    assert not fcntl.fcntl(blocking, fcntl.F_GETFL) & os.O_NONBLOCK


@pytest.mark.parametrize("make", MAKERS)
def test_the_counter_adds_wakes_a_poller_and_resets_on_read(make, fds):
    fd = make(0, EFD_CLOEXEC | EFD_NONBLOCK)
    fds.append(fd)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(0) == []
    with pytest.raises(BlockingIOError):
        eventfd_read(fd)
    eventfd_write(fd, 1)
    eventfd_write(fd, 2)
    assert poller.poll(1000) == [(fd, select.POLLIN)]
    assert eventfd_read(fd) == 3
    assert poller.poll(0) == []
    with pytest.raises(BlockingIOError):
        eventfd_read(fd)


@pytest.mark.parametrize("make", MAKERS)
def test_an_initial_value_is_readable_at_once(make, fds):
    fd = make(7, EFD_CLOEXEC | EFD_NONBLOCK)
    fds.append(fd)
    assert eventfd_read(fd) == 7


def test_glibc_refusing_is_an_oserror_with_its_errno():
    with pytest.raises(OSError) as e:
        libc_eventfd(0, 0x40000000)  # no such flag: EINVAL
    assert e.value.errno == errno.EINVAL


def test_the_flags_are_the_kernels():
    # <sys/eventfd.h>: EFD_CLOEXEC = O_CLOEXEC, EFD_NONBLOCK = O_NONBLOCK
    assert (EFD_CLOEXEC, EFD_NONBLOCK) == (os.O_CLOEXEC, os.O_NONBLOCK)
