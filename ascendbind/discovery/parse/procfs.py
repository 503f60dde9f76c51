"""Parsers for /proc text and ``ps -Te``. Pure: text in, frozen values out.

Kernel facts these rely on:
* ``/proc/<pid>/stat``: the comm (field 2) is in parentheses and may contain
  spaces and ``)`` itself, so fields are counted from the *last* ``)``.
  Field 22 is the start time in clock ticks since boot; with the pid it
  identifies a process across pid reuse. Field 9 is the task's ``PF_*`` flags:
  ``PF_KTHREAD`` marks a kernel thread, whatever name it chose.
* ``/proc/<pid>/environ`` is NUL-separated ``KEY=value`` entries, as the process's
  memory holds them now (it may have rewritten them; nothing stops a key appearing
  twice). ``getenv(3)`` scans from the start and returns the first ``KEY=``, and so
  do the runtimes that read the Ascend variables: the first entry of a key wins here too.
* ``/proc/<pid>/cgroup`` lines are ``id:controllers:path``; cgroup v1 names
  ``cpuset`` among the controllers, the v2 line is ``0::/path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ...values.cpulist import parse_cpulist
from ...values.digits import ascii_int
from ...errors import ParseError

__all__ = [
    "ProcStatus",
    "ProcStat",
    "PF_KTHREAD",
    "CgroupEntry",
    "PsThread",
    "parse_status",
    "parse_stat",
    "parse_stat_start_time",
    "parse_environ",
    "cut_environ",
    "ENVIRON_LIMIT",
    "real_uid",
    "parse_cgroup",
    "cpuset_cgroup",
    "parse_ps_te",
]


@dataclass(frozen=True)
class ProcStatus:
    name: str | None
    tgid: int | None
    state: str | None
    cpus_allowed: frozenset[int] | None
    mems_allowed: frozenset[int] | None
    ppid: int | None = None
    uids: tuple[int, ...] = ()  # real, effective, saved, filesystem


def parse_status(text: str, source: str = "/proc/self/status") -> ProcStatus:
    fields: dict[str, tuple[str, int, str]] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        key, sep, value = line.partition(":")
        if not sep:
            if line.strip():
                raise ParseError(source, "expected 'Key:<tab>value'", line=lineno, text=line)
            continue
        fields.setdefault(key.strip(), (value.strip(), lineno, line))
    if not fields:
        raise ParseError(source, "empty status file")

    def cpus(key: str) -> frozenset[int] | None:
        if key not in fields:
            return None
        raw, lineno, line = fields[key]
        try:
            return parse_cpulist(raw)
        except ValueError as exc:
            raise ParseError(source, f"{key}: {exc}", line=lineno, text=line) from None

    def numbers(key: str) -> tuple[int, ...] | None:
        if key not in fields:
            return None
        raw, lineno, line = fields[key]
        try:
            return tuple(int(x) for x in raw.split())
        except ValueError:
            raise ParseError(source, f"{key} {raw!r} is not a number", line=lineno, text=line) from None

    tgid, ppid = numbers("Tgid"), numbers("PPid")
    return ProcStatus(
        name=fields["Name"][0] if "Name" in fields else None,
        tgid=tgid[0] if tgid else None,
        state=fields["State"][0] if "State" in fields else None,
        cpus_allowed=cpus("Cpus_allowed_list"),
        mems_allowed=cpus("Mems_allowed_list"),
        ppid=ppid[0] if ppid else None,
        uids=numbers("Uid") or (),
    )


def real_uid(text: str) -> int | None:
    """The real uid (the first ``Uid:`` field) of ``/proc/<pid>/status`` text, or None."""
    start = text.find("\nUid:")
    if start < 0:
        return None
    end = text.find("\n", start + 5)
    fields = (text[start + 5 :] if end < 0 else text[start + 5 : end]).split()
    return ascii_int(fields[0]) if fields else None


# include/linux/sched.h: set on every kernel thread (kthreadd and its children)
PF_KTHREAD = 0x00200000
PF_EXITING = 0x00000004  # set as do_exit begins, before the memory is torn down


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` that identify a process."""

    comm: str
    state: str
    ppid: int
    flags: int
    start_time: int

    @property
    def is_kthread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)

    @property
    def is_exiting(self) -> bool:
        """In ``do_exit``: its memory is being torn down (the state is not Z until that ends)."""
        return bool(self.flags & PF_EXITING)


def parse_stat(text: str, source: str = "/proc/self/stat") -> ProcStat:
    """comm (2), state (3), ppid (4), flags (9) and starttime (22) of ``/proc/<pid>/stat``."""
    open_ = text.find("(")
    close = text.rfind(")")
    if open_ < 0 or close < open_:
        raise ParseError(source, "no '(comm)' field", line=1, text=text)
    rest = text[close + 1 :].split()
    # rest[0] is field 3 (state), so field N is rest[N - 3]
    if len(rest) < 20:
        raise ParseError(source, f"only {len(rest) + 2} fields, need 22", line=1, text=text)
    values = {}
    for name, index in (("ppid", 1), ("flags", 6), ("starttime", 19)):
        try:
            values[name] = int(rest[index])
        except ValueError:
            raise ParseError(source, f"{name} {rest[index]!r} is not a number", line=1, text=text) from None
    return ProcStat(text[open_ + 1 : close], rest[0], values["ppid"], values["flags"], values["starttime"])


def parse_stat_start_time(text: str, source: str = "/proc/self/stat") -> int:
    """Field 22 (starttime) of ``/proc/<pid>/stat``."""
    return parse_stat(text, source).start_time


def parse_environ(text: str) -> dict[str, str]:
    """``KEY=value`` entries -> a dict, the first entry of a key winning (getenv's answer).
    Entries without ``=`` or with an empty key are skipped, as getenv never matches them."""
    env: dict[str, str] = {}
    setdefault = env.setdefault
    for entry in text.split("\0"):
        key, sep, value = entry.partition("=")
        if sep and key:
            setdefault(key, value)
    return env


# the most of a worker's environ the daemon reads: a real one is a few KiB (tens with a
# namespace's service links); past this, its first complete entries are used (cut_environ)
ENVIRON_LIMIT = 256 << 10


def cut_environ(text: str, limit: int = ENVIRON_LIMIT) -> tuple[str, str | None]:
    """(the complete entries of ``text`` that lie within its first ``limit`` characters, and a
    sentence when anything was left out, else None). An environment read with a cap ends
    where the cap fell, possibly inside an entry: that entry is dropped whole rather than
    read as a shorter value (a cut ``0,1,2`` would name other devices). ``text`` is what a
    capped read returned: more than ``limit`` characters means the file went on."""
    if len(text) <= limit and (not text or text.endswith("\0")):
        return text, None
    kept = text[: text.rfind("\0", 0, limit) + 1]
    over = f"longer than the {limit}-byte cap" if len(text) > limit else "not NUL-terminated"
    return kept, f"environ {over}: its first {kept.count(chr(0))} complete entries read, the rest ignored"


@dataclass(frozen=True)
class CgroupEntry:
    hierarchy: int
    controllers: tuple[str, ...]
    path: str


def parse_cgroup(text: str, source: str = "/proc/self/cgroup") -> tuple[CgroupEntry, ...]:
    out: list[CgroupEntry] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            raise ParseError(source, "expected 'id:controllers:/path'", line=lineno, text=line)
        try:
            hierarchy = int(parts[0])
        except ValueError:
            raise ParseError(source, f"hierarchy id {parts[0]!r} is not a number", line=lineno, text=line) from None
        controllers = tuple(c for c in parts[1].split(",") if c)
        out.append(CgroupEntry(hierarchy, controllers, parts[2]))
    return tuple(out)


def cpuset_cgroup(entries: tuple[CgroupEntry, ...]) -> tuple[str, str] | None:
    """("v1", path) for a v1 cpuset hierarchy, else ("v2", path) for the unified
    line, else None. v1 wins on hybrid hosts: the cpuset controller lives there."""
    for e in entries:
        if "cpuset" in e.controllers:
            return ("v1", e.path)
    for e in entries:
        if e.hierarchy == 0 and not e.controllers:
            return ("v2", e.path)
    return None


class PsThread(NamedTuple):
    pid: int
    tid: int
    comm: str


def parse_ps_te(text: str, source: str = "ps -Te") -> tuple[PsThread, ...]:
    """``ps -Te`` (PID SPID TTY TIME CMD). CMD is the thread's comm and may hold spaces."""
    header: list[str] | None = None
    out: list[PsThread] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if header is None:
            header = line.split()
            if "PID" not in header or header[-1] not in ("CMD", "COMMAND"):
                raise ParseError(source, "expected the 'PID SPID TTY TIME CMD' header", line=lineno, text=line)
            tid_col = next((c for c in ("SPID", "LWP", "TID") if c in header), None)
            if tid_col is None:
                raise ParseError(source, "header has no SPID/LWP column", line=lineno, text=line)
            continue
        cells = line.split(None, len(header) - 1)
        if len(cells) < len(header) - 1:
            raise ParseError(source, f"row has {len(cells)} cells, header has {len(header)}", line=lineno, text=line)
        row = dict(zip(header, cells))
        pid, tid = ascii_int(row["PID"]), ascii_int(row[tid_col])
        if pid is None or tid is None:
            raise ParseError(source, "PID/SPID is not a number", line=lineno, text=line)
        out.append(PsThread(pid, tid, row.get(header[-1], "")))
    if header is None:
        raise ParseError(source, "no 'PID SPID ...' header found (empty output)")
    return tuple(out)
