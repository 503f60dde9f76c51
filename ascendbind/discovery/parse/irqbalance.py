"""irqbalance's control protocol as values: its ``setup`` reply parsed, its ban command
built, the ban list merged. Pure: no socket, no file (applier/irqbalance.py talks).

What irqbalance (1.x, built with its UI socket) says and accepts:

* ``setup`` is answered with one line of space-separated tokens::

      SLEEP 10 IRQ 421 LOAD 0 DIFF 0 CLASS 0 IRQ 423 LOAD 0 DIFF 0 CLASS 0 BANNED 00000000

  ``SLEEP`` is its pass interval in seconds, each ``IRQ`` group one entry of its
  ban list (``--banirq`` ones and those set over the socket alike), ``BANNED``
  the CPUs it keeps IRQs off (a kernel-style hex mask).
* ``settings ban irqs 421 423`` *replaces* the whole ban list, ``--banirq`` ones
  included; ``settings ban irqs NONE`` empties it. Hence read, merge, write.
* It reads a command with one ``recvmsg`` into a 500-byte buffer: a longer one
  would be cut silently, so it is refused here instead (``BanListTooLong``).
* It parses the list with ``strtoul`` until a number reads 0: IRQ 0 is kept only
  in first place, and an empty list would read as "IRQ 0". The list is sent in
  ascending order and never empty (``NONE``), which keeps both true.
* ``settings cpus 2-39,42`` *replaces* the CPUs it keeps IRQs off (a cpu list),
  overriding what it chose at start: ``IRQBALANCE_BANNED_CPUS`` (a hex mask) or
  ``IRQBALANCE_BANNED_CPULIST`` from its environment, else the CPUs the kernel
  keeps isolated (``isolcpus=``) or tickless (``nohz_full=``). ``settings cpus
  NULL`` goes back to that choice. It takes effect at its next pass (up to
  ``SLEEP`` seconds later), so ``BANNED`` in ``setup`` shows the new set only
  then. An empty list would crash 1.9 (it reads the first token of it), so one
  is never sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ...values.cpulist import format_cpulist, parse_cpulist, parse_mask
from ...values.digits import ascii_int
from ...errors import ParseError

__all__ = [
    "IrqbalanceSetup",
    "BanListTooLong",
    "parse_setup",
    "ban_command",
    "list_with",
    "list_without",
    "SOURCE",
    "MAX_COMMAND",
    "SOCKET_DIR",
    "socket_path",
    "ABSTRACT_ADDRESS",
    "cpus_command",
    "CPUS_RESET",
    "auto_banned_cpus",
]

SOURCE = "irqbalance setup reply"
MAX_COMMAND = 500  # irqbalance's receive buffer
BAN_PREFIX = "settings ban irqs "
CPUS_PREFIX = "settings cpus "
CPUS_RESET = CPUS_PREFIX + "NULL"
# where irqbalance binds when its runtime directory exists (systemd: RuntimeDirectory=irqbalance)
SOCKET_DIR = "/run/irqbalance"
# its fallback binds a zeroed sockaddr_un: an abstract address of 108 NUL bytes
# (sun_path's size on Linux), the same for every pid
ABSTRACT_ADDRESS = b"\0" * 108


def socket_path(pid: int) -> str:
    return f"{SOCKET_DIR}/irqbalance{pid}.sock"


@dataclass(frozen=True)
class IrqbalanceSetup:
    sleep_seconds: int
    banned_irqs: frozenset[int]
    banned_cpus: str  # hex mask text as irqbalance printed it


class BanListTooLong(ValueError):
    """The ban command would exceed irqbalance's 500-byte receive buffer."""


def _int(token: str | None, what: str, text: str) -> int:
    if token is None:
        raise ParseError(SOURCE, f"ends where {what} was expected", text=text)
    value = ascii_int(token)
    if value is None:
        raise ParseError(SOURCE, f"{what} is not a number: {token!r}", text=text)
    return value


def parse_setup(text: str) -> IrqbalanceSetup:
    """The ``setup`` reply as values; ParseError for anything else (no reply, a
    truncated reply, another program's words)."""
    tokens = text.split()
    if not tokens:
        raise ParseError(SOURCE, "empty reply")
    it = iter(tokens)

    def expect(word: str) -> None:
        got = next(it, None)
        if got != word:
            raise ParseError(SOURCE, f"expected {word!r}, got {got!r}", text=text)

    expect("SLEEP")
    sleep = _int(next(it, None), "the SLEEP value", text)
    banned: set[int] = set()
    word = next(it, None)
    while word == "IRQ":
        irq = _int(next(it, None), "an IRQ number", text)
        if irq < 0:
            raise ParseError(SOURCE, f"negative IRQ number {irq}", text=text)
        for field in ("LOAD", "DIFF", "CLASS"):
            expect(field)
            _int(next(it, None), f"the {field} value of IRQ {irq}", text)
        banned.add(irq)
        word = next(it, None)
    if word != "BANNED":
        raise ParseError(SOURCE, f"expected 'IRQ' or 'BANNED', got {word!r}", text=text)
    mask = next(it, None)
    if mask is None or not all(c in "0123456789abcdefABCDEF," for c in mask):
        raise ParseError(SOURCE, f"BANNED is not a CPU mask: {mask!r}", text=text)
    extra = next(it, None)
    if extra is not None:
        raise ParseError(SOURCE, f"unexpected {extra!r} after the BANNED mask", text=text)
    return IrqbalanceSetup(sleep, frozenset(banned), mask)


def ban_command(irqs: Iterable[int]) -> str:
    """The command that makes ``irqs`` irqbalance's whole ban list."""
    wanted = sorted(set(irqs))
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in wanted):
        raise ValueError(f"IRQ numbers must be non-negative integers: {wanted!r}")
    command = BAN_PREFIX + (" ".join(map(str, wanted)) if wanted else "NONE")
    if len(command) > MAX_COMMAND:
        raise BanListTooLong(
            f"a ban list of {len(wanted)} IRQs takes {len(command)} bytes; irqbalance reads at most {MAX_COMMAND}"
        )
    return command


def list_with(current: frozenset[int], ours: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
    """(the whole list to send, the IRQs this adds). IRQs already on the list are not
    added by us, so they are never ours to take off again."""
    ours = frozenset(ours)
    return current | ours, ours - current


def list_without(current: frozenset[int], ours: Iterable[int]) -> frozenset[int]:
    """The list with exactly ``ours`` taken off; everyone else's bans stay."""
    return current - frozenset(ours)


def cpus_command(cpus: Iterable[int]) -> str:
    """The command that makes ``cpus`` irqbalance's whole banned-CPU set (never empty)."""
    wanted = frozenset(cpus)
    if not wanted:
        raise ValueError("an empty banned-CPU list is never sent (irqbalance 1.9 crashes on it); reset it instead")
    command = CPUS_PREFIX + format_cpulist(wanted)
    if len(command) > MAX_COMMAND:
        raise BanListTooLong(f"a banned-CPU list of {len(wanted)} CPUs takes {len(command)} bytes; irqbalance "
                             f"reads at most {MAX_COMMAND}")
    return command


def auto_banned_cpus(env: Mapping[str, str], kernel_isolated: frozenset[int]) -> frozenset[int] | None:
    """The CPUs irqbalance bans when told ``settings cpus NULL``: from its environment,
    else the kernel's isolated and tickless CPUs. None when its environment names
    them in a form this cannot read (then the set is sent as a list instead)."""
    try:
        mask = env.get("IRQBALANCE_BANNED_CPUS", "")
        if mask.strip():
            return parse_mask(mask)
        cpulist = env.get("IRQBALANCE_BANNED_CPULIST", "")
        if cpulist.strip():
            return parse_cpulist(cpulist)
    except ValueError:
        return None
    return frozenset(kernel_isolated)