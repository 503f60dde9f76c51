"""Where host text comes from: the live host, or a snapshot directory (SPEC §5).

The I/O edge is this one small interface, so discovery code is written once and
tests inject a SnapshotHost instead of monkeypatching:

    run(argv)      -> stdout text, or None when the command does not exist there
    read(path)     -> file text, or None when the file is absent / unreadable
    listdir(path)  -> sorted names, or None when the directory is absent

``argv[0]`` is the *logical* tool name ("npu-smi", "lscpu", "ps"); LiveHost maps
"npu-smi" to the configured binary. Paths are absolute host paths ("/proc/…",
"/sys/…"); LiveHost re-roots them under ``proc_root`` / ``sys_root`` and a
SnapshotHost under its directory.

Commands run with ``LC_ALL=C``, no shell, a timeout (retried once: a hung
``npu-smi`` is usually a transient driver stall). A non-zero exit or a second
timeout is a CommandFailed naming the command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Protocol

from tenacity import retry, retry_if_exception_type, stop_after_attempt

from ..errors import CommandFailed

__all__ = ["HostSource", "LiveHost", "SnapshotHost", "command_file_name"]


class HostSource(Protocol):
    def run(self, argv: Sequence[str]) -> str | None: ...

    def read(self, path: str) -> str | None: ...

    def listdir(self, path: str) -> list[str] | None: ...


def command_file_name(argv: Sequence[str]) -> str:
    """``npu-smi info -t topo`` -> ``npu-smi_info_-t_topo.txt`` (SPEC §5)."""
    return "_".join(argv) + ".txt"


class _Timeout(Exception):
    pass


class LiveHost:
    """The machine we run on."""

    def __init__(
        self,
        *,
        npu_smi: str = "npu-smi",
        timeout: float = 10.0,
        proc_root: str = "/proc",
        sys_root: str = "/sys",
    ) -> None:
        self.tools = {"npu-smi": npu_smi}
        self.timeout = timeout
        self.proc_root = proc_root.rstrip("/") or "/"
        self.sys_root = sys_root.rstrip("/") or "/"

    @classmethod
    def from_config(cls, config) -> LiveHost:
        return cls(
            npu_smi=config.npu_smi,
            timeout=config.command_timeout_seconds,
            proc_root=config.proc_root,
            sys_root=config.sys_root,
        )

    def resolve_tool(self, name: str) -> str | None:
        return shutil.which(self.tools.get(name, name))

    def run(self, argv: Sequence[str]) -> str | None:
        exe = self.resolve_tool(argv[0])
        if exe is None:
            return None
        full = [exe, *argv[1:]]
        env = {"LC_ALL": "C", "LANG": "C", "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
        # our own ASCENDBIND_* variables travel along (the fixture npu-smi of
        # tests and `make run` reads ASCENDBIND_FIXTURE_HOST / _FAKE_NPU_PIDS)
        env.update({k: v for k, v in os.environ.items() if k.startswith("ASCENDBIND_")})
        try:
            proc = self._run_with_retry(full, env)
        except _Timeout:
            raise CommandFailed(
                f"command {' '.join(argv)!s} timed out after {self.timeout:g}s (twice)", code="command_timeout"
            ) from None
        except OSError as exc:
            raise CommandFailed(f"command {' '.join(argv)} could not start: {exc.strerror}") from None
        if proc.returncode != 0:
            err = (proc.stderr or proc.stdout or "").strip().splitlines()
            tail = err[-1] if err else "no output"
            raise CommandFailed(f"command {' '.join(argv)} exited {proc.returncode}: {tail[:200]}")
        return proc.stdout

    @retry(retry=retry_if_exception_type(_Timeout), stop=stop_after_attempt(2), reraise=True)
    def _run_with_retry(self, full: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(
                full,
                capture_output=True,
                text=True,
                errors="replace",
                env=env,
                timeout=self.timeout,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise _Timeout() from None

    def host_path(self, path: str) -> str:
        if path == "/proc" or path.startswith("/proc/"):
            return self.proc_root + path[len("/proc") :]
        if path == "/sys" or path.startswith("/sys/"):
            return self.sys_root + path[len("/sys") :]
        return path

    def read(self, path: str) -> str | None:
        try:
            with open(self.host_path(path), encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError, PermissionError, IsADirectoryError):
            return None
        except OSError:
            # e.g. ESRCH while a task exits under us
            return None

    def listdir(self, path: str) -> list[str] | None:
        try:
            return sorted(os.listdir(self.host_path(path)))
        except OSError:
            return None


class SnapshotHost:
    """A directory recorded by ``ascendbind snapshot`` (or written as a fixture)."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        meta_path = os.path.join(self.directory, "meta.json")
        self.meta: dict = {}
        if os.path.exists(meta_path):
            with open(meta_path, encoding="utf-8") as fh:
                self.meta = json.load(fh)

    def run(self, argv: Sequence[str]) -> str | None:
        return self._read_file(os.path.join(self.directory, "cmd", command_file_name(argv)))

    def host_path(self, path: str) -> str:
        return os.path.join(self.directory, path.lstrip("/"))

    def read(self, path: str) -> str | None:
        return self._read_file(self.host_path(path))

    def listdir(self, path: str) -> list[str] | None:
        try:
            return sorted(os.listdir(self.host_path(path)))
        except OSError:
            return None

    @staticmethod
    def _read_file(path: str) -> str | None:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            return None
