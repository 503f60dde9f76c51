"""Where host text comes from: the live host, or a snapshot directory.

The I/O edge is this one small interface, so discovery code is written once and
tests inject a SnapshotHost instead of monkeypatching:

    run(argv)      -> stdout text, or None when the command does not exist there
    read(path)     -> file text, or None when the file is absent / unreadable;
                      read(path, limit=N) stops after N+1 characters, so a caller
                      can refuse a file longer than N without holding all of it
    listdir(path)  -> sorted names, or None when the directory is absent

``argv[0]`` is the *logical* tool name ("npu-smi", "lscpu", "ps"); LiveHost maps
"npu-smi" to the configured binary. Paths are absolute host paths ("/proc/…",
"/sys/…", "/var/lib/kubelet/…"); LiveHost re-roots them under ``proc_root`` /
``sys_root`` / ``kubelet_root`` and a
SnapshotHost under its directory.

Commands run with ``LC_ALL=C``, no shell and a timeout, each in a process
group of its own that is killed whole when the timeout expires (see
``ascendbind.command``). A timeout is not retried: a hung ``npu-smi`` costs one
timeout, and the daemon's host cache decides when to ask again. A non-zero exit
or a timeout is a CommandFailed naming the command (code ``command_timeout``
for the latter).

Two optional reads a source may offer (a caller without them records the evidence as
unavailable): ``readlink(path)`` -> a link's target (a namespace link such as
``/proc/<pid>/ns/mnt``), and ``char_devices(path, major)`` -> the character devices of
``major`` in a directory, never following a link (a snapshot holds that listing as a
text file at the same path, since it cannot hold device nodes).

``open_process(key)`` (optional) opens one process's ``/proc/<key>`` as a
``ProcDir`` (procdir.py) whose reads all describe that one process (LiveHost holds
the directory open; ``path_proc_dir`` adapts any other source path by path).

What a worker controls may never answer: LiveHost lists a ``/dev`` under
``/proc/<pid>/root`` and reads a process's ``environ`` and ``cmdline`` (copied out
of its memory) on deadline.py's readers, so such a read costs a request at most
their deadline (DiscoveryError ``read_timeout``).

``OneTimeoutPerTool`` wraps a source for one discovery pass: after a tool
timed out, the pass's later runs of that tool (one board query per NPU die)
fail at once instead of each waiting out the timeout again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Protocol

from ...command import CommandsStopped, run_command, tool_env
from ...values.digits import ascii_int
from ...errors import CommandFailed
from ...values.targeting import DeviceNode
from .deadline import MEMORY_FILES, READERS, Readers
from .bounded import read_bounded
from .procdir import LiveProcDir, ProcDir
from ..parse.devices import parse_char_devices
from ..parse.procfs import real_uid
from .devnodes import scan_char_devices

# kubelet's state directory: the CPU manager checkpoint (discovery/parse/kubelet.py) lives there
_KUBELET = "/var/lib/kubelet"

__all__ = ["HostSource", "LiveHost", "SnapshotHost", "OneTimeoutPerTool", "command_file_name", "is_snapshot_dir",
           "path_proc_dir", "read_parsed"]


class HostSource(Protocol):
    def run(self, argv: Sequence[str]) -> str | None: ...

    def read(self, path: str, limit: int | None = None) -> str | None: ...

    def listdir(self, path: str) -> list[str] | None: ...


class _PathProcDir:
    """``/proc/<key>`` of any HostSource, read path by path (a snapshot is one moment anyway)."""

    pinned = False
    owner = None

    def __init__(self, source: HostSource, key: str) -> None:
        self.source, self.base = source, f"/proc/{key}"

    def read(self, name: str, limit: int | None = None) -> str | None:
        path = f"{self.base}/{name}"
        return self.source.read(path) if limit is None else self.source.read(path, limit=limit)

    def listdir(self, name: str) -> list[str] | None:
        return self.source.listdir(f"{self.base}/{name}")

    def close(self) -> None:
        pass


def read_parsed(source: HostSource, path: str, parse):
    """(``parse(text)``, None) for the file at ``path``, or (None, why): it is unreadable, or
    ``parse`` raised a ParseError (whose sentence names the file and the line)."""
    from ...errors import ParseError

    text = source.read(path)
    if text is None:
        return None, f"{path} is unreadable"
    try:
        return parse(text), None
    except ParseError as exc:
        return None, str(exc)


def path_proc_dir(source: HostSource, key: str) -> ProcDir:
    """``/proc/<key>`` of ``source`` read path by path (an absent process reads as no files).
    Never listed whole: a recording source would record every name in it."""
    return _PathProcDir(source, key)


def command_file_name(argv: Sequence[str]) -> str:
    """``npu-smi info -t topo`` -> ``npu-smi_info_-t_topo.txt``."""
    return "_".join(argv) + ".txt"


class _HostTree:
    """A tree of files standing for the host's (the host itself, or a snapshot of it): a
    host path maps to one of its files by ``host_path``, and is listed there."""

    def host_path(self, path: str) -> str:
        raise NotImplementedError

    def listdir(self, path: str) -> list[str] | None:
        try:
            return sorted(os.listdir(self.host_path(path)))
        except OSError:
            return None


class LiveHost(_HostTree):
    """The machine we run on."""

    def __init__(
        self,
        *,
        npu_smi: str = "npu-smi",
        timeout: float = 10.0,
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        kubelet_root: str = "/var/lib/kubelet",
        readers: Readers | None = None,
    ) -> None:
        self.readers = readers if readers is not None else READERS
        self.tools = {"npu-smi": npu_smi}
        self.timeout = timeout
        self.proc_root = proc_root.rstrip("/") or "/"
        self.sys_root = sys_root.rstrip("/") or "/"
        self.kubelet_root = kubelet_root.rstrip("/") or "/"

    @classmethod
    def from_config(cls, config) -> LiveHost:
        return cls(
            npu_smi=config.npu_smi,
            timeout=config.command_timeout_seconds,
            proc_root=config.proc_root,
            sys_root=config.sys_root,
            kubelet_root=config.kubelet_root,
        )

    def resolve_tool(self, name: str) -> str | None:
        return shutil.which(self.tools.get(name, name))

    def run(self, argv: Sequence[str]) -> str | None:
        exe = self.resolve_tool(argv[0])
        if exe is None:
            return None
        # our own ASCENDBIND_* variables travel along (the fixture npu-smi of
        # tests and `make run` reads ASCENDBIND_FIXTURE_HOST / _FAKE_NPU_PIDS)
        env = tool_env({k: v for k, v in os.environ.items() if k.startswith("ASCENDBIND_")})
        shown = " ".join(argv)
        try:
            proc = run_command([exe, *argv[1:]], timeout=self.timeout, env=env)
        except subprocess.TimeoutExpired:
            raise CommandFailed(f"command {shown} timed out after {self.timeout:g}s", code="command_timeout") from None
        except CommandsStopped as exc:
            raise CommandFailed(f"command {shown} {exc.strerror}") from None
        except OSError as exc:
            raise CommandFailed(f"command {shown} could not start: {exc.strerror or exc}") from None
        if proc.returncode != 0:
            err = (proc.stderr or proc.stdout or "").strip().splitlines()
            tail = err[-1] if err else "no output"
            raise CommandFailed(f"command {shown} exited {proc.returncode}: {tail[:200]}")
        return proc.stdout

    def host_path(self, path: str) -> str:
        if path == "/proc" or path.startswith("/proc/"):
            return self.proc_root + path[len("/proc") :]
        if path == "/sys" or path.startswith("/sys/"):
            return self.sys_root + path[len("/sys") :]
        if path.startswith(_KUBELET + "/"):
            return self.kubelet_root + path[len(_KUBELET):]
        return path

    def read(self, path: str, limit: int | None = None) -> str | None:
        key, name = self._proc_file(path)
        if name in MEMORY_FILES or name.startswith("root/"):
            kind = name if name in MEMORY_FILES else "root"
            return self.readers.read(kind, path, lambda: self._read(path, limit), worker=ascii_int(key),
                                     owner=self._owner(key))
        return self._read(path, limit)

    def _read(self, path: str, limit: int | None) -> str | None:
        return read_bounded(self.host_path(path), limit)

    @staticmethod
    def _proc_file(path: str) -> tuple[str, str]:
        """("<key>", "rest") of a path ``/proc/<key>/rest``, else ("", "")."""
        parts = path.split("/", 3)
        return (parts[2], parts[3]) if len(parts) == 4 and parts[1] == "proc" else ("", "")

    def _owner(self, key: str) -> int | None:
        """The real uid of process ``key``, to charge a stuck read of it to (deadline.py)."""
        if ascii_int(key) is None:
            return None
        text = read_bounded(self.host_path(f"/proc/{key}/status"), 4096, single=True)
        return None if text is None else real_uid(text)

    def readlink(self, path: str) -> str | None:
        try:
            return os.readlink(self.host_path(path))
        except OSError:
            return None

    def char_devices(self, path: str, major: int) -> list[DeviceNode] | None:
        """On ``readers``: under ``/proc/<pid>/root`` the directory is the worker's to mount."""
        key = self._proc_file(path)[0]
        return self.readers.read("dev", path, lambda: scan_char_devices(self.host_path(path), major),
                                 worker=ascii_int(key), owner=self._owner(key))

    def open_process(self, key: str) -> LiveProcDir | None:
        """``/proc/<key>`` held open (None when there is no such process)."""
        try:
            fd = os.open(self.host_path(f"/proc/{key}"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        return LiveProcDir(fd, key, self.readers)


class OneTimeoutPerTool:
    """A view of ``inner`` for one discovery pass: once a tool timed out, its
    later runs in this pass raise at once (same code, ``command_timeout``).

    Everything else (``read``, ``listdir``, attributes such as ``host_path``
    or ``meta``) is ``inner``'s. Make a new one per pass: it never forgets.
    """

    def __init__(self, inner: HostSource) -> None:
        self.inner = inner
        self._hung: dict[str, str] = {}

    def run(self, argv: Sequence[str]) -> str | None:
        tool = argv[0]
        if tool in self._hung:
            raise CommandFailed(
                f"command {' '.join(argv)} not run: {self._hung[tool]} earlier in this discovery",
                code="command_timeout",
            )
        try:
            return self.inner.run(argv)
        except CommandFailed as exc:
            if exc.code == "command_timeout":
                self._hung[tool] = str(exc).removeprefix("command ")
            raise

    def read(self, path: str, limit: int | None = None) -> str | None:
        return self.inner.read(path) if limit is None else self.inner.read(path, limit=limit)

    def listdir(self, path: str) -> list[str] | None:
        return self.inner.listdir(path)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


# what ``ascendbind snapshot`` writes; a directory with none of these is not a snapshot
SNAPSHOT_ENTRIES = ("meta.json", "cmd", "proc", "sys")


def is_snapshot_dir(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name)) for name in SNAPSHOT_ENTRIES)


def _load_meta(path: str) -> dict:
    """``meta.json``, checked: a JSON object whose ``env`` maps strings to
    strings and whose ``pid`` is a positive integer or null. Anything else is
    a ParseError naming the file (a hand-edited or truncated bug report must
    not become a traceback). Keys it does not know are kept, unread."""
    from ...errors import ParseError

    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ParseError(path, f"cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParseError(path, f"not UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise ParseError(path, "empty; expected a JSON object")
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise ParseError(path, f"not valid JSON: {exc}", line=getattr(exc, "lineno", None)) from None
    if not isinstance(meta, dict):
        raise ParseError(path, f"expected a JSON object, got {type(meta).__name__}")
    env = meta.get("env")
    if env is not None and not (
        isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise ParseError(path, f"'env' must be an object of strings, got {json.dumps(env)[:80]}")
    pid = meta.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0):
        raise ParseError(path, f"'pid' must be a positive integer or null, got {json.dumps(pid)[:40]}")
    for key in ("arch",):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ParseError(path, f"{key!r} must be a string, got {json.dumps(meta[key])[:40]}")
    return meta


class SnapshotHost(_HostTree):
    """A directory recorded by ``ascendbind snapshot`` (or written as a fixture).

    ``recorded_pid`` is the worker the snapshot was taken for (``meta.json``'s
    ``pid``), None for a snapshot of ``proc/self``: callers plan for it when
    they are given no pid. Raises ParseError for a malformed ``meta.json``.
    """

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        meta_path = os.path.join(self.directory, "meta.json")
        self.meta: dict = _load_meta(meta_path) if os.path.exists(meta_path) else {}
        self.recorded_pid: int | None = self.meta.get("pid")

    def run(self, argv: Sequence[str]) -> str | None:
        return read_bounded(os.path.join(self.directory, "cmd", command_file_name(argv)))

    def host_path(self, path: str) -> str:
        return os.path.join(self.directory, path.lstrip("/"))

    def read(self, path: str, limit: int | None = None) -> str | None:
        return read_bounded(self.host_path(path), limit)

    def readlink(self, path: str) -> str | None:
        text = self.read(path)
        return text.strip() if text is not None and text.strip() else None

    def char_devices(self, path: str, major: int) -> list[DeviceNode] | None:
        """The recorded listing at ``path`` (``NAME MAJOR:MINOR`` lines), nodes of ``major`` only."""
        text = self.read(path)
        return None if text is None else [n for n in parse_char_devices(text, path) if n.major == major]
