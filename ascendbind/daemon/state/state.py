"""The daemon's checkpoint: ``state_dir/state.json``.

What it holds: one small record per bound worker, what reconcile, release and
status need and nothing more: pid, start time and (with pidfs) pidfd inode,
NPUs, the plan's mode and role CPUs, its alignment decision (without the hints), the affinity before
binding, the IRQ writes (NPU, IRQ, CPUs, previous mask, status), the masks
release writes back, the IRQs added to irqbalance's ban list, the UVB threads'
previous masks, and the step results without their data. CPU sets are kernel
cpu lists ("0-23,48"): a 192-CPU set is a few bytes instead of 192 numbers. A
restarted daemon keeps reconciling its workers and ``release`` can still undo
what an earlier daemon did.

A bind is written here before its first mask write, as an *in-flight* record
(``"in_flight": true``, no step results yet, the IRQ masks it will write as
they were): a daemon killed among the writes leaves it, and the next one
undoes it at start. The bind's final record replaces it. The key is one more
in a record of the same version: an older daemon reads it as a held worker.

Beside the workers, one host-wide record (``isolation``, daemon/isolate/rules/records.py):
every mask isolation changed on the host (other devices' IRQs, the default
mask of new IRQs, the NPU driver's threads and workqueues) with the value it
had before, and irqbalance's banned CPUs. It is written *before* each change,
so a daemon killed between the two still knows what to put back. It has a
checksum of its own (``isolation_checksum``), so a reader of version 2 that
predates it still reads the workers.

Invariants:
* Written only in a directory no other user can change (statedir.py): the
  daemon refuses to start with any other ``state_dir``, since a name planted
  there (a symlink where root's temp file goes) would make root overwrite any
  file on the host.
* Written atomically: a temp file in the same directory, created exclusively
  (``O_EXCL|O_NOFOLLOW``, mode 0600, an unpredictable name), then swapped with
  ``state.json`` in one ``renameat2(RENAME_EXCHANGE)`` and the previous file
  unlinked under the temp name (a plain rename where there is no ``state.json``
  yet or the file system cannot exchange). A reader sees the old file or the new
  one, never half of one, and never no file. Every operation goes through one
  descriptor of the directory opened without following links, so no path is
  looked up twice.
* Written once per change, before the change is answered (a bind: also once
  before its first write), and not fsynced. The
  file has to outlive the daemon process, not the machine: its entries name
  pids and IRQ masks of this boot, and after a reboot they are dropped unread
  (the boot id). A crashed or killed daemon loses nothing: write(2) and
  rename(2) are in the page cache, which the next daemon reads. Only a kernel
  crash or a power loss can lose or tear the file, and both start a new boot,
  whose daemon drops the old entries anyway; a torn file fails its checksum
  and is moved aside like any corrupt one. An fsync of the file and of the
  directory would buy nothing the boot id does not already throw away, and
  cost a disk flush on every bind.
* At start, stale temp files (``state.json.tmp-*``, left by a crash) are
  removed, and a ``state.json`` that is not a regular file (a directory, a
  fifo, a symlink) is moved aside like a corrupt one.
* Versioned and checksummed (sha256 over the version, the boot id and the
  canonical JSON of ``workers``). A file that fails to parse, has an unknown
  version or a bad checksum is *corrupt*: it is moved aside
  (``state.json.corrupt-<unix time>``) with a log line, and the daemon starts
  empty. Never a crash loop. A file of the previous version (whole plans, IRQ
  writes inside the step reports) is read and its entries converted.
* Permission-checked: the daemon acts as root on the pids and IRQ masks in this
  file, so a file that another user owns or can write is not trusted: moved
  aside like a corrupt one.
* Stamped with the boot id (``/proc/sys/kernel/random/boot_id``, read through
  discovery): entries of another boot name pids and IRQ masks of a machine
  that no longer exists; they are dropped without restoring anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from ...discovery.gather.host import read_boot_id as _boot_id_of
from ...discovery.read.sources import LiveHost
from ...errors import ConfigError
from .staterecord import binding_from_v1, binding_to_json
from .statedir import trusted_state_dir, untrusted_reason

__all__ = ["StateFile", "LoadResult", "encode_record", "read_boot_id", "STATE_VERSION", "ISOLATION_VERSION"]

STATE_VERSION = 2
ISOLATION_VERSION = 1  # the isolation record's own format, inside a version-2 file
log = structlog.get_logger("ascendbind.state")


def read_boot_id(proc_root: str = "/proc") -> str:
    return _boot_id_of(LiveHost(proc_root=proc_root))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def encode_record(record: dict[str, Any]) -> str:
    """One worker's record as it stands in the file (canonical JSON): ``save_encoded`` takes these."""
    return _canonical(record)


def _checksum(version: int, boot_id: str, workers_text: str) -> str:
    """sha256 over the version, the boot id and the canonical JSON of the workers."""
    return hashlib.sha256(f"{version}\n{boot_id}\n{workers_text}".encode()).hexdigest()


def _isolation_checksum(boot_id: str, isolation_text: str) -> str:
    """sha256 over the isolation record's version, the boot id and its canonical JSON."""
    return hashlib.sha256(f"isolation {ISOLATION_VERSION}\n{boot_id}\n{isolation_text}".encode()).hexdigest()


def _checksum_v1(boot_id: str, workers: list) -> str:
    return hashlib.sha256(_canonical({"version": 1, "boot_id": boot_id, "workers": workers}).encode()).hexdigest()


def _upgrade_v1(entry: Any) -> Any:
    """A version-1 entry (whole plan, IRQ writes in the step report) as a current record;
    the entry unchanged when it does not parse, so the loader reports it as malformed."""
    if not isinstance(entry, dict):
        return entry
    try:
        binding = binding_from_v1(entry)
    except (KeyError, ValueError, TypeError, AttributeError):
        return entry
    held = {k: v for k, v in entry.items() if k not in _V1_BINDING_KEYS}
    return binding_to_json(binding, **held)


_V1_BINDING_KEYS = {"pid", "start_time", "npus", "plan", "original_cpus", "saved_irq_masks", "steps",
                    "irqbalance_bans"}


@dataclass
class LoadResult:
    workers: list[dict[str, Any]] = field(default_factory=list)  # entries of this boot, raw
    other_boot: int = 0  # entries dropped because they belong to another boot
    moved_aside: str | None = None  # where a corrupt/untrusted file went
    problem: str | None = None  # why it was moved aside
    isolation: dict[str, Any] | None = None  # the host-wide isolation record of this boot, raw


STATE_NAME = "state.json"
TEMP_PREFIX = STATE_NAME + ".tmp-"


class StateFile:
    def __init__(self, state_dir: str, *, proc_root: str = "/proc") -> None:
        self.dir = state_dir
        self.path = os.path.join(state_dir, STATE_NAME)
        self.boot_id = read_boot_id(proc_root)
        self._real: str | None = None

    def prepare(self) -> str:
        """Create/check ``state_dir`` (ConfigError ``state_dir_untrusted`` when another user
        could change it); returns its real path. The daemon calls this before anything else."""
        self._real = trusted_state_dir(self.dir)
        return self._real

    def _open_dir(self) -> int:
        """A descriptor of the checked directory, rechecked: a directory that became
        writable by others since start is refused, not written to."""
        real = self._real or self.prepare()
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        why = untrusted_reason(self.dir, os.fstat(fd), final=True)
        if why is not None:
            os.close(fd)
            raise ConfigError(f"state_dir {self.dir} is no longer safe for root's state: {why}",
                              code="state_dir_untrusted")
        return fd

    def clean(self) -> dict[str, Any]:
        """Start-up tidying: remove stale temp files; move a non-regular state.json aside."""
        dfd = self._open_dir()
        removed: list[str] = []
        moved = None
        try:
            for name in os.listdir(dfd):
                if not name.startswith(TEMP_PREFIX):
                    continue
                try:
                    # unlink never follows a symlink: a planted link goes, its target stays
                    if stat.S_ISDIR(os.lstat(name, dir_fd=dfd).st_mode):
                        os.rmdir(name, dir_fd=dfd)
                    else:
                        os.unlink(name, dir_fd=dfd)
                    removed.append(name)
                except OSError as exc:
                    log.error("stale temp file not removed", name=name, error=exc.strerror)
            try:
                st = os.lstat(STATE_NAME, dir_fd=dfd)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):
                moved = self._move_aside_at(dfd, f"not a regular file ({_kind(st.st_mode)})").moved_aside
        finally:
            os.close(dfd)
        if removed:
            log.warning("removed stale state temp files", names=removed)
        return {"removed": removed, "moved_aside": moved}

    def save(self, workers: list[dict[str, Any]], isolation: dict[str, Any] | None = None) -> None:
        """Replace the file with ``workers`` (records of ``binding_to_json``) and the
        isolation record (None or empty: none): write, rename."""
        self.save_encoded([_canonical(w) for w in workers], isolation=isolation)

    def save_encoded(self, records: list[str], isolation: dict[str, Any] | None = None) -> None:
        """``save`` of records already encoded by ``encode_record``: the canonical JSON of a
        list is its items' canonical JSON joined by commas, so the file and its checksum are
        the same bytes as ``save`` of the records would write."""
        workers_text = "[" + ",".join(records) + "]"
        extra = ""
        if isolation:
            text = _canonical(isolation)
            extra = f'"isolation":{text},"isolation_checksum":"{_isolation_checksum(self.boot_id, text)}",'
        # the workers are encoded once: the checksum is over the very text the file holds
        data = (f'{{"boot_id":{json.dumps(self.boot_id)},'
                f'"checksum":"{_checksum(STATE_VERSION, self.boot_id, workers_text)}",{extra}'
                f'"version":{STATE_VERSION},"written_at":{time.time()!r},'
                f'"workers":{workers_text}}}\n').encode()
        dfd = self._open_dir()
        try:
            tmp, fd = _create_exclusive(dfd)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                swapped = _exchange(dfd, tmp, STATE_NAME)
                if not swapped:
                    os.replace(tmp, STATE_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            if swapped:
                # the temp name now holds the previous file; one left by a crash right here
                # is a stale temp file, removed at the next start
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
        finally:
            os.close(dfd)

    def _untrusted(self, st: os.stat_result, what: str) -> str | None:
        if st.st_uid != os.geteuid():
            return f"{what} is owned by uid {st.st_uid}, not {os.geteuid()}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        return None

    def _move_aside_at(self, dfd: int, problem: str) -> LoadResult:
        base = f"{STATE_NAME}.corrupt-{int(time.time())}"
        dest, n = base, 0
        while _exists_at(dfd, dest):  # only root writes here: no one can take the name in between
            n += 1
            dest = f"{base}-{n}"
        try:
            os.rename(STATE_NAME, dest, src_dir_fd=dfd, dst_dir_fd=dfd)
            where = os.path.join(self.dir, dest)
        except OSError as exc:
            where = f"(could not move: {exc.strerror})"
        log.error("state file not used", path=self.path, problem=problem, moved_to=where)
        return LoadResult(moved_aside=where, problem=problem)

    def load(self) -> LoadResult:
        try:
            dfd = self._open_dir()
        except ConfigError as exc:
            log.error("state directory not trusted; starting empty", problem=str(exc))
            return LoadResult(problem=str(exc))
        try:
            return self._load_at(dfd)
        finally:
            os.close(dfd)

    def _load_at(self, dfd: int) -> LoadResult:
        try:
            # O_NONBLOCK: opening a planted fifo must not hang the daemon
            fd = os.open(STATE_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            return LoadResult()
        except OSError as exc:
            return self._move_aside_at(dfd, f"cannot open: {exc.strerror}")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return self._move_aside_at(dfd, f"not a regular file ({_kind(st.st_mode)})")
            problem = self._untrusted(st, f"state file {self.path}")
            if problem:
                return self._move_aside_at(dfd, problem)
            with os.fdopen(fd, "rb", closefd=False) as fh:
                raw = fh.read(64 << 20)
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("top level is not an object")
            version, boot_id, workers = doc["version"], doc["boot_id"], doc["workers"]
            if version not in (1, STATE_VERSION) or isinstance(version, bool):
                raise ValueError(f"unknown version {version!r} (this daemon writes {STATE_VERSION}, reads 1 too)")
            if not isinstance(workers, list) or not isinstance(boot_id, str):
                raise ValueError("workers is not a list or boot_id is not a string")
            expected = (_checksum_v1(boot_id, workers) if version == 1
                        else _checksum(version, boot_id, _canonical(workers)))
            if doc.get("checksum") != expected:
                raise ValueError("checksum mismatch")
            isolation = doc.get("isolation")
            if isolation is not None:
                if version == 1 or not isinstance(isolation, dict):
                    raise ValueError("the isolation record is not an object of a version-2 file")
                if doc.get("isolation_checksum") != _isolation_checksum(boot_id, _canonical(isolation)):
                    raise ValueError("isolation checksum mismatch")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            return self._move_aside_at(dfd, f"corrupt: {exc}")
        if boot_id != self.boot_id:
            log.info("state file is from another boot; dropping its workers without touching IRQs",
                     workers=len(workers), file_boot_id=boot_id)
            return LoadResult(other_boot=len(workers))
        if version == 1:
            log.info("state file of version 1 read; its entries are converted", workers=len(workers))
            workers = [_upgrade_v1(w) for w in workers]
        return LoadResult(workers=[w for w in workers if isinstance(w, dict)], isolation=isolation)


_RENAME_EXCHANGE = 2  # renameat2(2) flag: swap two names atomically
_renameat2: Any = None


def _libc_renameat2() -> Any:
    """glibc's renameat2, or False where the C library lacks it (glibc < 2.28, musl < 1.2.5)."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):
            _renameat2 = False
    return _renameat2


def _exchange(dfd: int, new: str, old: str) -> bool:
    """Swap the names ``new`` and ``old`` in ``dfd`` atomically; False when they were not
    swapped (``old`` does not exist yet, or the kernel, file system or C library cannot),
    and the caller renames instead.

    Why not rename(2) over ``old``: ext4 (auto_da_alloc, the default) starts writeback of
    the renamed file's data inside rename(2) whenever it replaces an existing name, a
    guard for programs that skip fsync. It costs about 0.1 ms of wall clock a write here
    and buys nothing this file needs (it must outlive the daemon, not the machine). An
    exchange leaves both names in place, so ext4 does not take it for a replacing
    rename; readers still see the old file or the new one, never neither."""
    fn = _libc_renameat2()
    if not fn:
        return False
    if fn(dfd, new.encode(), dfd, old.encode(), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), old)


def _create_exclusive(dfd: int) -> tuple[str, int]:
    """(name, fd) of a new 0600 temp file: O_EXCL fails on any existing name, a planted
    symlink included, and O_NOFOLLOW makes sure of it; the name is unpredictable."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        name = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            return name, os.open(name, flags, 0o600, dir_fd=dfd)
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "could not create a fresh state temp file")


def _exists_at(dfd: int, name: str) -> bool:
    try:
        os.lstat(name, dir_fd=dfd)
    except FileNotFoundError:
        return False
    return True


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return word
    return "not a file"
