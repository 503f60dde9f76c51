"""A running irqbalance: find it, tell it to leave the pinned NPU IRQs alone, hand them back.

irqbalance rewrites the mask of every IRQ it balances on each pass, so an SQ/CQ
IRQ pinned by the IRQ step would be moved again. With ``irqbalance = "ban"``
(the default) the IRQs ascendbind pins go on irqbalance's ban list over its
control socket, and come off again on release; ``stop`` stops the service
(``systemctl``); ``warn`` only reports it.

Finding it is discovery's (``irqhost.irqbalance_pids``, a scan of
``<proc>/*/comm``). Talking to it (discovery/parse/irqbalance.py has the words):

* Where: ``/run/irqbalance/irqbalance<pid>.sock`` as irqbalance sees it, that
  is through ``<proc>/<pid>/root``: systemd runs it in a mount namespace of its
  own, and a test in a private ``/run``. The directory is opened first and the
  socket reached through ``/proc/self/fd/<n>/``, which keeps the address short
  of sun_path's 108 bytes whatever ``proc_root`` is. Without that directory,
  irqbalance falls back to the abstract address of 108 NUL bytes. An abstract
  address belongs to whoever binds it first, any user, so before a word is
  sent the peer's SO_PEERCRED must be irqbalance's pid and uid 0.
* How: one command per connection. irqbalance obeys only a message carrying
  SCM_CREDENTIALS of uid 0 (it closes the connection silently otherwise, so a
  non-root caller gets no reply); it answers ``setup``, then closes. Every
  exchange of one operation shares one deadline (``command_timeout_seconds``):
  a hung irqbalance costs one timeout. A reply is read up to ``MAX_REPLY`` bytes.
* What: the ban list is replaced as a whole, so it is read (``setup``), merged
  and written back, then read again to check. Only the IRQs that were not on it
  are ours (``IrqbalanceBans``); release takes off exactly those and only from
  the same irqbalance process (pid and start time): the list lives in its
  memory, and a restarted irqbalance's list is its command line's, not ours.

Between our read and our write another writer's change to the list would be
lost: irqbalance offers no compare-and-swap. The window is one round trip; the
daemon makes its own changes one at a time under its lock.

Isolation tells it which CPUs to keep IRQs off (``tell_banned_cpus``): the
set it banned before (the operator's own: its environment, ``isolcpus=``)
plus the bound workers' CPUs. ``reset_banned_cpus`` puts the set back: with
``settings cpus NULL`` when that gives back exactly the set it had, else by
sending that set.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..command import run_command, tool_env
from ..discovery.parse.irqbalance import (
    ABSTRACT_ADDRESS,
    CPUS_RESET,
    BanListTooLong,
    IrqbalanceSetup,
    ban_command,
    cpus_command,
    list_with,
    list_without,
    parse_setup,
    socket_path,
)
from ..discovery.gather.irqhost import irqbalance_socket_dir, socket_in_dir_fd
from ..discovery.gather.process import read_identity
from ..errors import ParseError
from ..values.model import IrqbalanceBans

__all__ = [
    "stop_irqbalance",
    "Unreachable",
    "IrqbalanceLink",
    "BanResult",
    "ban_irqs",
    "unban_irqs",
    "hand_back",
    "banned_cpus",
    "tell_banned_cpus",
    "reset_banned_cpus",
    "MAX_REPLY",
]

MAX_REPLY = 1 << 20  # a setup reply is ~45 bytes per banned IRQ
_UCRED = struct.Struct("3i")  # pid_t, uid_t, gid_t


class Unreachable(Exception):
    """irqbalance runs but could not be told; the message says why."""


def stop_irqbalance(timeout: float = 10.0) -> tuple[bool, str]:
    """``systemctl stop irqbalance`` (argv, no shell). Returns (stopped, sentence)."""
    exe = shutil.which("systemctl")
    if exe is None:
        return False, "systemctl not found, irqbalance left running"
    try:
        proc = run_command([exe, "stop", "irqbalance"], timeout=timeout, env=tool_env())
    except subprocess.TimeoutExpired:
        return False, f"systemctl stop irqbalance timed out after {timeout:g}s"
    except OSError as exc:
        return False, f"systemctl could not start: {exc.strerror}"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()
        return False, f"systemctl stop irqbalance exited {proc.returncode}: {tail[-1] if tail else 'no output'}"
    return True, "irqbalance stopped (systemctl stop irqbalance)"


class IrqbalanceLink:
    """Commands to the irqbalance ``pid``, all within one deadline."""

    def __init__(self, pid: int, timeout: float, *, proc_root: str = "/proc") -> None:
        self.pid = pid
        self.deadline = time.monotonic() + max(0.0, timeout)
        self.proc_root = proc_root
        self.where = "its abstract socket"

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Unreachable(f"irqbalance (pid {self.pid}) did not answer in time on {self.where}")
        return left

    def _connect(self) -> socket.socket:
        """A socket connected to irqbalance: its socket file, else its abstract address
        (the order irqbalance's own UI tries them)."""
        path = socket_path(self.pid)
        try:
            dir_fd = os.open(irqbalance_socket_dir(self.pid, os.path.dirname(path), self.proc_root),
                             os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            dir_fd = None
        if dir_fd is not None:
            try:
                return self._connect_to(socket_in_dir_fd(dir_fd, os.path.basename(path)), path)
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            finally:
                os.close(dir_fd)
        return self._connect_to(ABSTRACT_ADDRESS, "its abstract socket")

    def _connect_to(self, address: str | bytes, where: str) -> socket.socket:
        self.where = where
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(self._left())
            s.connect(address)
        except BaseException:
            s.close()
            raise
        return s

    def exchange(self, command: str) -> bytes:
        """Send one command; the reply, read until irqbalance closes (b"" when it says nothing)."""
        try:
            with self._connect() as s:
                pid, uid, _gid = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                if pid != self.pid or uid != 0:
                    raise Unreachable(f"{self.where} is held by pid {pid} (uid {uid}), not by irqbalance "
                                      f"(pid {self.pid}) as root; nothing sent")
                creds = _UCRED.pack(os.getpid(), os.geteuid(), os.getegid())
                s.settimeout(self._left())
                s.sendmsg([command.encode("ascii")], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
                reply = bytearray()
                while True:
                    s.settimeout(self._left())
                    chunk = s.recv(65536)
                    if not chunk:
                        return bytes(reply)
                    reply += chunk
                    if len(reply) > MAX_REPLY:
                        raise Unreachable(f"irqbalance (pid {self.pid}) replied more than {MAX_REPLY} bytes")
        except socket.timeout:
            raise Unreachable(f"irqbalance (pid {self.pid}) did not answer in time on {self.where}") from None
        except OSError as exc:
            raise Unreachable(f"irqbalance (pid {self.pid}) on {self.where}: {exc.strerror or exc}") from None

    def setup(self) -> IrqbalanceSetup:
        reply = self.exchange("setup")
        if not reply:
            raise Unreachable(f"irqbalance (pid {self.pid}) closed without a reply "
                              f"(it answers only root, uid {os.geteuid()} asked)")
        try:
            return parse_setup(reply.decode("ascii", "replace"))
        except ParseError as exc:
            raise Unreachable(str(exc)) from None

    def replace_bans(self, irqs: Iterable[int], *, added: Iterable[int] = (), removed: Iterable[int] = ()) -> None:
        """Make ``irqs`` the whole ban list, then read it back: Unreachable unless every
        IRQ of ``added`` is on it and none of ``removed`` (the rest is others' to change)."""
        try:
            command = ban_command(irqs)
        except BanListTooLong as exc:
            raise Unreachable(str(exc)) from None
        self.exchange(command)
        now = self.setup().banned_irqs
        missing, left = frozenset(added) - now, frozenset(removed) & now
        if missing or left:
            raise Unreachable(f"irqbalance (pid {self.pid}) bans {_irqs(now)} after being told {_irqs(irqs)}")


def _irqs(irqs: Iterable[int]) -> str:
    listed = sorted(irqs)
    return "IRQs " + ", ".join(map(str, listed)) if listed else "no IRQ"


@dataclass(frozen=True)
class BanResult:
    """``status``: banned (bans = what we added) | unreachable (sentence says why)."""

    status: str
    sentence: str
    bans: IrqbalanceBans | None = None


def ban_irqs(pid: int, irqs: Iterable[int], *, proc_root: str, timeout: float) -> BanResult:
    """Put ``irqs`` on irqbalance ``pid``'s ban list, keeping every ban it has."""
    irqs = frozenset(irqs)
    ident = read_identity(pid, proc_root)
    if ident is None:
        return BanResult("unreachable", f"irqbalance (pid {pid}) exited before it could be told")
    link = IrqbalanceLink(pid, timeout, proc_root=proc_root)
    try:
        whole, added = list_with(link.setup().banned_irqs, irqs)
        if added:
            link.replace_bans(whole, added=added)
    except Unreachable as exc:
        return BanResult("unreachable", f"irqbalance was not told to leave {_irqs(irqs)} alone: {exc}")
    bans = IrqbalanceBans(pid, ident.start_time, added) if added else None
    kept = irqs - added
    sentence = f"irqbalance (pid {pid}) leaves {_irqs(irqs)} alone"
    if kept:
        sentence += f" ({_irqs(kept)} on its list already: not ours to lift)"
    return BanResult("banned", sentence, bans)


def unban_irqs(bans: IrqbalanceBans, irqs: Iterable[int], *, proc_root: str,
               timeout: float) -> IrqbalanceBans | None:
    """Take ``irqs`` (ours) off the list of the irqbalance ``bans`` names; the bans left.
    Unreachable when it could not be told."""
    irqs = bans.irqs & frozenset(irqs)
    if not irqs:
        return bans
    link = IrqbalanceLink(bans.pid, timeout, proc_root=proc_root)
    current = link.setup().banned_irqs
    if current & irqs:
        link.replace_bans(list_without(current, irqs), removed=irqs)
    return bans.only(bans.irqs - irqs)


def hand_back(bans: IrqbalanceBans, *, proc_root: str, timeout: float) -> tuple[str, str]:
    """Release: take our bans off. (status, sentence); status: handed back | gone (the
    irqbalance that holds them has exited: nothing to do) | unreachable (it runs and
    could not be told: the IRQs stay banned)."""
    ident = read_identity(bans.pid, proc_root)
    if ident is None or ident.comm != "irqbalance" or ident.start_time != bans.start_time:
        return "gone", (f"irqbalance (pid {bans.pid}) that banned {_irqs(bans.irqs)} is gone; "
                        "its ban list went with it")
    try:
        unban_irqs(bans, bans.irqs, proc_root=proc_root, timeout=timeout)
    except Unreachable as exc:
        return "unreachable", f"{_irqs(bans.irqs)} stay banned in irqbalance: {exc}"
    return "handed back", f"irqbalance (pid {bans.pid}) balances {_irqs(bans.irqs)} again"


def banned_cpus(pid: int, *, proc_root: str, timeout: float) -> str:
    """The ``BANNED`` mask irqbalance ``pid`` reports (hex text); Unreachable otherwise."""
    return IrqbalanceLink(pid, timeout, proc_root=proc_root).setup().banned_cpus


def tell_banned_cpus(pid: int, cpus: Iterable[int], *, proc_root: str, timeout: float) -> str:
    """Make ``cpus`` the CPUs irqbalance ``pid`` keeps IRQs off (from its next pass on);
    returns the command sent. Unreachable when it could not be told (no answer, a list
    over its command limit)."""
    try:
        command = cpus_command(cpus)
    except (BanListTooLong, ValueError) as exc:
        raise Unreachable(str(exc)) from None
    IrqbalanceLink(pid, timeout, proc_root=proc_root).exchange(command)
    return command


def reset_banned_cpus(pid: int, original: frozenset[int] | None, *, proc_root: str, timeout: float) -> str:
    """Give irqbalance ``pid`` back its banned CPUs: ``original`` as a list, or (None) the
    set it chooses itself (``settings cpus NULL``). Returns the command sent."""
    link = IrqbalanceLink(pid, timeout, proc_root=proc_root)
    command = CPUS_RESET
    if original:
        try:
            command = cpus_command(original)
        except BanListTooLong as exc:
            raise Unreachable(str(exc)) from None
    link.exchange(command)
    return command