"""The Ascend variables of a worker's environment, as the container runtime and the NPU
runtime read them. Pure.

* ``ASCEND_VISIBLE_DEVICES`` is read by Ascend's container runtime when it creates
  the container: the devices to put in it, as ids (``0,1``), ranges (``0-3``) or
  chip names (``Ascend910-3``), or ``void`` for none. The device plugin sets it to
  physical ids (Ascend 950: logic ids); HAMi to the physical id a vNPU is cut from;
  with ``ASCEND_RUNTIME_OPTIONS`` holding ``VIRTUAL`` the ids are vNPU udevids.
* ``ASCEND_RT_VISIBLE_DEVICES`` is read by the NPU runtime inside the process: a
  comma-separated list of indexes into the devices the process sees, in the order
  the runtime will number them ("1,0": device 0 is the second one).

Malformed values are a ValueError with a sentence naming the value: guessing
which NPU a worker meant would bind it to the wrong CPUs.

The worker writes these values, so reading them costs time linear in their length
whatever they hold: an id is at most ``ID_DIGITS`` ASCII digits (``digits.py``: no
other script's digits), no id or range end may pass ``MAX_ID``, and the ids a value
names are counted as it is read (a range by its two ends, before it is expanded):
past ``MAX_ID + 1`` of them, duplicates included, it is refused, so no value makes
the daemon expand or insert more than that many.
"""

from __future__ import annotations

import re

from ...values.cpulist import IdRanges
from ...values.digits import is_ascii_digits

__all__ = ["parse_visible_devices", "parse_rt_visible_devices", "is_virtual", "MAX_ID"]

# the container runtime refuses ranges past this; so do we, so a typo cannot make a huge set
MAX_ID = 1 << 12
ID_DIGITS = 6  # leading zeros allowed, as the runtime's strconv.Atoi takes them
_ID = f"[0-9]{{1,{ID_DIGITS}}}"
# re.ASCII: without it, \s, [A-Za-z] under IGNORECASE ("ſ" is "s") and the case folding reach past ASCII
_NAMED = re.compile(rf"(?:Ascend[0-9A-Za-z]*|npu)-({_ID})", re.IGNORECASE | re.ASCII)
_RANGE = re.compile(rf"({_ID})[ \t]*-[ \t]*({_ID})", re.ASCII)


def _shown(name: str, raw: str) -> str:
    return f"{name}={raw[:80]!r}{'…' if len(raw) > 80 else ''}"


def parse_visible_devices(raw: str) -> tuple[int, ...]:
    """``ASCEND_VISIBLE_DEVICES`` -> the sorted ids it names (``void``: none)."""
    text = raw.strip()
    if text.lower() == "void":
        return ()
    ids = IdRanges(MAX_ID)
    for item in text.split(","):
        item = item.strip()
        if len(item) <= ID_DIGITS and is_ascii_digits(item):
            lo = hi = int(item)
        elif (m := _NAMED.fullmatch(item)) is not None:
            lo = hi = int(m.group(1))
        elif (m := _RANGE.fullmatch(item)) is not None:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise ValueError(f"{_shown('ASCEND_VISIBLE_DEVICES', raw)}: range {item!r} runs backwards")
        else:
            raise ValueError(f"{_shown('ASCEND_VISIBLE_DEVICES', raw)}: {item[:40]!r} is not a device id, range or "
                             "chip name (ASCII digits only)")
        broken = ids.add(lo, hi)
        if broken == IdRanges.PAST:
            raise ValueError(f"{_shown('ASCEND_VISIBLE_DEVICES', raw)}: id {hi} is out of range (at most {MAX_ID})")
        if broken == IdRanges.TOO_MANY:
            raise ValueError(f"{_shown('ASCEND_VISIBLE_DEVICES', raw)}: names more than {MAX_ID + 1} ids")
    return tuple(sorted(ids.ids))


def parse_rt_visible_devices(raw: str) -> tuple[int, ...]:
    """``ASCEND_RT_VISIBLE_DEVICES`` -> the indexes it lists, in its order."""
    out: list[int] = []
    seen: set[int] = set()
    for item in raw.split(","):
        item = item.strip()
        if not (len(item) <= ID_DIGITS and is_ascii_digits(item)) or int(item) > MAX_ID:
            raise ValueError(f"{_shown('ASCEND_RT_VISIBLE_DEVICES', raw)} is not a comma-separated list of device "
                             f"indexes (ASCII digits, at most {MAX_ID})")
        index = int(item)
        if index in seen:
            raise ValueError(f"{_shown('ASCEND_RT_VISIBLE_DEVICES', raw)} lists index {index} twice")
        seen.add(index)
        out.append(index)
    return tuple(out)


def is_virtual(options: str | None) -> bool:
    """Whether ``ASCEND_RUNTIME_OPTIONS`` says the visible ids are vNPUs."""
    return options is not None and "VIRTUAL" in {o.strip().upper() for o in options.split(",")}
