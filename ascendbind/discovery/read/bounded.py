"""One bounded read of a file, and a task's CPU affinity: the two ways the package looks at a
file of ``/proc`` or ``/sys`` (or a recorded snapshot of them) and at a task's mask.

The limit rule, the same for every caller: the answer holds at most ``limit + 1`` of the
file's units, characters for text and bytes with ``binary=True``, so an answer longer than
``limit`` says that the file went on (a caller that cares cuts it and says so; one that
does not parses what it got). ``limit=None`` reads the file whole. Text is UTF-8 with
undecodable bytes replaced, decoded as it is read, so the bound counts what the caller will
measure with ``len``. The answer is None when the file cannot be opened or read: absent, not
a file, not permitted, or ESRCH when the task it describes exits between the open and the
read. Gone is news for the caller, never an error.

Kernel facts it relies on:

* A seq_file hands out at most its buffer (a page, grown to fit one record) per
  ``read(2)``, so a long file (``/proc/interrupts``, ``environ``) is read a piece at a
  time until the kernel says end of file. A file the kernel prints as one record
  (``stat``, ``status``, ``comm``, ``schedstat``, a mask) comes whole from the first
  read: ``single=True`` makes exactly one ``read`` of at most ``limit + 1`` bytes (no second
  call to see the end), the per-thread hot path of a scrape or an observation. A character
  is at least a byte, so its text keeps the rule; such a file is far below its limit.
* Each piece is asked for at most 64 KiB: ``read(n)`` allocates ``n`` bytes first, and
  asking a large bound for every page of /proc text would map and unmap a buffer each time.
* ``os.open``/``os.read``: no buffering and no decoding surprises; ``dir_fd`` reads a
  name relative to a directory held open (``/proc/<pid>`` pinned to one process).
"""

from __future__ import annotations

import codecs
import os
from typing import Literal, overload

__all__ = ["read_bounded", "task_affinity", "PIECE"]

PIECE = 1 << 16
_FLAGS = os.O_RDONLY | os.O_CLOEXEC

# A task's CPU affinity (``sched_getaffinity(2)``): a set of CPU numbers; raises OSError
# (ESRCH) once the thread is gone, and EINVAL/EPERM as the kernel does. Bound once to the
# builtin, not wrapped: the watch loop calls it once per thread of every worker it looks at,
# and a Python frame around it would cost more than the system call.
task_affinity = os.sched_getaffinity


@overload
def read_bounded(path: str, limit: int | None = None, *, dir_fd: int | None = None, binary: Literal[False] = False,
                 single: bool = False) -> str | None: ...


@overload
def read_bounded(path: str, limit: int | None = None, *, dir_fd: int | None = None, binary: Literal[True],
                 single: bool = False) -> bytes | None: ...


def read_bounded(path: str, limit: int | None = None, *, dir_fd: int | None = None, binary: bool = False,
                 single: bool = False) -> str | bytes | None:
    """The file at ``path`` (relative to ``dir_fd`` when given), at most ``limit + 1``
    characters of it, or with ``binary`` bytes (None: all of it); None when it cannot be
    read. ``single``: one ``read(2)``, for a file the kernel prints whole at once."""
    try:
        fd = os.open(path, _FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if single:
            raw = os.read(fd, PIECE if limit is None else limit + 1)
            return raw if binary else raw.decode("utf-8", "replace")
        return _bytes(fd, limit) if binary else _text(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _bytes(fd: int, limit: int | None) -> bytes:
    """Reads of ``fd`` until end of file or past ``limit`` bytes."""
    chunks, left = [], None if limit is None else limit + 1
    while left is None or left > 0:
        chunk = os.read(fd, PIECE if left is None else min(PIECE, left))
        if not chunk:
            break
        chunks.append(chunk)
        if left is not None:
            left -= len(chunk)
    return b"".join(chunks)


def _text(fd: int, limit: int | None) -> str:
    """Reads of ``fd``, decoded as they come, until end of file or past ``limit`` characters.
    A piece asks for no more bytes than the characters still wanted (a character is at
    least a byte), so nothing is read far past the bound."""
    decode = codecs.getincrementaldecoder("utf-8")("replace").decode
    pieces, left = [], None if limit is None else limit + 1
    while left is None or left > 0:
        chunk = os.read(fd, PIECE if left is None else min(PIECE, left))
        piece = decode(chunk, final=not chunk)
        pieces.append(piece)
        if not chunk:
            break
        if left is not None:
            left -= len(piece)
    text = "".join(pieces)
    return text if limit is None else text[:limit + 1]
