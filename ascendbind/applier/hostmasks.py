"""Kernel mask files isolation writes: an IRQ's ``smp_affinity``, the default mask
of new IRQs (``/proc/irq/default_smp_affinity``), an unbound workqueue's
``cpumask`` (hex masks) and the soft-lockup watchdog's ``watchdog_cpumask`` (a
cpu list).

The same discipline as the IRQ step (irq.py): ``os.open``/``os.write``, because
procfs and sysfs report a refused value at write(2) and buffered I/O would
report it only at close; every write is read back through discovery. A value
the kernel will never take is ``unchangeable`` and never retried: EPERM or EIO
from a managed IRQ (its affinity belongs to the kernel), or IRQ 0. A file that
is gone (the IRQ freed, the workqueue destroyed) is ``gone``.

``exact``: a restore writes back the text read before the first change, and
must read back that very text, byte for byte; a change compares CPU sets (the
kernel prints a mask at its own width).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from ..values.cpulist import parse_mask
from ..values.decisions import MaskWrite
from ..discovery.read.bounded import read_bounded

__all__ = ["write_mask_file"]

_UNCHANGEABLE = (errno.EPERM, errno.EIO)
_GONE = (errno.ENOENT, errno.ENODEV, errno.ESRCH)


def _read(path: str) -> str | None:
    text = read_bounded(path, 4096, single=True)
    return None if text is None else text.strip()


def _same(a: str | None, b: str, parse: Callable[[str], frozenset[int]]) -> bool:
    try:
        return a is not None and parse(a) == parse(b)
    except ValueError:
        return False


def write_mask_file(key: str, path: str, text: str, *, exact: bool = False,
                    parse: Callable[[str], frozenset[int]] = parse_mask) -> MaskWrite:
    """Write the mask ``text`` to ``path`` and read it back (``key`` names it in the result;
    ``parse`` reads the file's format: a hex mask, or a cpu list)."""
    previous = _read(path)
    if previous is None:
        return MaskWrite(key, "gone", None, None, f"{path} is gone or unreadable")
    try:
        # O_TRUNC is what a shell's `>` does (procfs and sysfs ignore it); it keeps fixture files exact
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode("ascii"))
        finally:
            os.close(fd)
    except OSError as exc:
        status = "unchangeable" if exc.errno in _UNCHANGEABLE else "gone" if exc.errno in _GONE else "failed"
        return MaskWrite(key, status, previous, _read(path), exc.strerror or str(exc))
    now = _read(path)
    if (now == text) if exact else _same(now, text, parse):
        return MaskWrite(key, "ok", previous, now)
    return MaskWrite(key, "failed", previous, now, f"wrote {text}, read back {now!r}")
