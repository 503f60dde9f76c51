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
"""

from __future__ import annotations

import re

__all__ = ["parse_visible_devices", "parse_rt_visible_devices", "is_virtual"]

_NAMED = re.compile(r"(?:Ascend[0-9A-Za-z]*|npu)-(\d+)", re.IGNORECASE)
_RANGE = re.compile(r"(\d+)\s*-\s*(\d+)")
# the container runtime refuses ranges past this; so do we, so a typo cannot make a huge set
_MAX_ID = 1 << 12


def parse_visible_devices(raw: str) -> tuple[int, ...]:
    """``ASCEND_VISIBLE_DEVICES`` -> the sorted ids it names (``void``: none)."""
    text = raw.strip()
    if text.lower() == "void":
        return ()
    ids: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        named, span = _NAMED.fullmatch(item), _RANGE.fullmatch(item)
        if item.isdigit():
            ids.add(int(item))
        elif named is not None:
            ids.add(int(named.group(1)))
        elif span is not None and int(span.group(1)) <= int(span.group(2)) <= _MAX_ID:
            ids.update(range(int(span.group(1)), int(span.group(2)) + 1))
        else:
            raise ValueError(f"ASCEND_VISIBLE_DEVICES={raw!r:.80}: {item!r:.40} is not a device id, range or chip name")
        if max(ids, default=0) > _MAX_ID:
            raise ValueError(f"ASCEND_VISIBLE_DEVICES={raw!r:.80}: id {max(ids)} is out of range")
    return tuple(sorted(ids))


def parse_rt_visible_devices(raw: str) -> tuple[int, ...]:
    """``ASCEND_RT_VISIBLE_DEVICES`` -> the indexes it lists, in its order."""
    out: list[int] = []
    for item in raw.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) > _MAX_ID:
            raise ValueError(f"ASCEND_RT_VISIBLE_DEVICES={raw!r:.80} is not a comma-separated list of device indexes")
        if int(item) in out:
            raise ValueError(f"ASCEND_RT_VISIBLE_DEVICES={raw!r:.80} lists index {item} twice")
        out.append(int(item))
    return tuple(out)


def is_virtual(options: str | None) -> bool:
    """Whether ``ASCEND_RUNTIME_OPTIONS`` says the visible ids are vNPUs."""
    return options is not None and "VIRTUAL" in {o.strip().upper() for o in options.split(",")}
