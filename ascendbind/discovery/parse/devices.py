"""Parsers for what says which NPU devices a process can reach. Pure: text in, values out.

Kernel and driver facts these rely on:
* The NPU driver registers one character-device region named ``devdrv-cdev``; its
  major is dynamic (``/proc/devices``: 236 is common, never fixed). Every
  ``/dev/davinciN`` and ``/dev/vdavinciN`` is a node of that major whose *minor is
  the device's udevid*. The name is not: on Ascend 950 ``N`` is the host's logic id,
  and a container runtime may rename a vNPU node ``davinciN``. So only the minor counts.
* cgroup v1 ``devices.list`` prints the whitelist, one ``TYPE MAJOR:MINOR ACCESS``
  per line (``*`` for any); a cgroup that allows everything prints ``a *:* rwm``
  alone. Opening an NPU needs read and write access.
* Drivers with the process map create ``/proc/trs_core/proc/<tgid>-<task>-dev-<udevid>``
  for every device context a process opens; ``<tgid>`` is the host's (the kernel's
  global) pid.
* ``/proc/<pid>/status``'s ``NSpid`` lists the process's pid in each pid namespace
  from the reader's down to its own: more than one means it lives in a pid
  namespace below the reader's, as a container's process does.
* A snapshot cannot hold device nodes, so it records the listing of a ``/dev``
  directory as text: one ``NAME MAJOR:MINOR`` line per node of the driver's major.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from ...errors import ParseError
from ...values.targeting import DeviceNode

__all__ = ["DEVDRV_CDEV", "devdrv_major", "allowed_minors", "trs_core_udevids", "parse_char_devices",
           "format_char_devices", "nested_pid_namespace"]

DEVDRV_CDEV = "devdrv-cdev"

_DEVICES_LINE = re.compile(r"\s*([0-9]+)\s+(\S.*?)\s*", re.ASCII)
_LIST_LINE = re.compile(r"([abc]) (\*|[0-9]+):(\*|[0-9]+) ([rwm]+)")
_TRS_NAME = re.compile(r"([0-9]+)-([0-9]+)-dev-([0-9]+)")
_NODE_LINE = re.compile(r"(\S+)\s+([0-9]+):([0-9]+)", re.ASCII)


def devdrv_major(text: str, source: str = "/proc/devices") -> int | None:
    """The major of the ``devdrv-cdev`` character devices, or None when the driver has none."""
    section = None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.rstrip().endswith(":"):
            section = line.strip().rstrip(":").lower()
            continue
        m = _DEVICES_LINE.fullmatch(line)
        if m is None:
            raise ParseError(source, "expected 'MAJOR name'", line=lineno, text=line)
        if section == "character devices" and m.group(2) == DEVDRV_CDEV:
            return int(m.group(1))
    return None


def allowed_minors(text: str, major: int, source: str = "devices.list") -> frozenset[int] | None:
    """The minors of ``major`` a v1 devices cgroup lets the process open for reading and
    writing; None when it allows every minor (a wildcard, or a cgroup that allows all)."""
    minors: set[int] = set()
    for m in _lines(text, _LIST_LINE, source, "expected 'TYPE MAJOR:MINOR ACCESS'"):
        kind, maj, minor, access = m.groups()
        if kind == "b" or not {"r", "w"} <= set(access):
            continue
        if kind == "a" or (maj in ("*", str(major)) and minor == "*"):
            return None
        if maj == str(major):
            minors.add(int(minor))
    return frozenset(minors)


def trs_core_udevids(names: Iterable[str], tgid: int) -> tuple[int, ...]:
    """The udevids the driver's process map lists for host pid ``tgid`` (other names ignored)."""
    found = set()
    for name in names:
        m = _TRS_NAME.fullmatch(name)
        if m is not None and int(m.group(1)) == tgid:
            found.add(int(m.group(3)))
    return tuple(sorted(found))


def parse_char_devices(text: str, source: str) -> tuple[DeviceNode, ...]:
    """A recorded listing (``NAME MAJOR:MINOR`` lines) back into device nodes."""
    out = [DeviceNode(m.group(1), int(m.group(2)), int(m.group(3)))
           for m in _lines(text, _NODE_LINE, source, "expected 'NAME MAJOR:MINOR'")]
    return tuple(sorted(out, key=lambda n: (n.minor, n.name)))


def _lines(text: str, pattern: re.Pattern, source: str, expected: str) -> Iterator[re.Match]:
    """The match of each non-blank line of ``text`` (stripped) with ``pattern``; a line that
    does not match is a ParseError naming it and saying what was ``expected``."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = pattern.fullmatch(line.strip())
        if m is None:
            raise ParseError(source, expected, line=lineno, text=line)
        yield m


def format_char_devices(nodes: Iterable[DeviceNode]) -> str:
    return "".join(f"{n.name} {n.major}:{n.minor}\n" for n in sorted(nodes, key=lambda n: (n.minor, n.name)))


def nested_pid_namespace(status: str) -> bool | None:
    """Whether ``/proc/<pid>/status`` says the process lives in a pid namespace below the
    reader's (``NSpid`` with more than one pid); None without a well-formed ``NSpid`` line."""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            pids = line[len("NSpid:"):].split()
            return len(pids) > 1 if pids and all(p.isascii() and p.isdigit() for p in pids) else None
    return None
