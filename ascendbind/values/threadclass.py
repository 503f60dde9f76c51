"""Thread classes: which CPUs of a worker's plan a thread belongs on, by its name. Pure.

Every thread of a bound worker goes to ``main``, except ``acl_thread*`` (the ACL
CPU) and ``release_thread*`` (the release CPU): the built-in rules. Serving stacks
run more kinds of thread and bind some of them themselves (UCM's ``ucm_*``
threads on the second half of the main CPUs, torch_npu's ``CPU_AFFINITY_CONF``
mode 2 by thread kind), so the ``thread_classes`` config key adds an ordered table
of classes in front of the built-in rules:

* a class matches a thread by fnmatch patterns (``*``, ``?``, ``[...]``, case
  sensitive) on its ``comm``, the kernel's name of at most 15 characters; the
  first class whose pattern matches wins, then the built-in rules, then main;
* a class sends its threads to a role (``main``, ``acl``, ``release``), or to a
  *share* of main: a span of main's CPUs by position, ``[from, to)`` as fractions
  of its length. Shares are cut from main, in sorted CPU order, each on its own:
  two classes may take the second half and the last quarter, and overlap.
  ``main`` itself is unchanged, so the threads of no class keep all of it.

Rounding (``carve``): a span of an ``n``-CPU main covers positions
``floor(from*n)`` to ``floor(to*n)``, so a half and the other half never overlap
and together cover main. A span that rounds to no CPU gets the one CPU at its
start (the last CPU of main when it starts at the end): a class never has an empty
mask, and with a 1-CPU main every share is that CPU, all of main.

The config limits (``MAX_CLASSES`` classes of ``MAX_PATTERNS`` patterns of at
most ``MAX_PATTERN_LEN`` characters, names from a small alphabet) keep the set of
class names, and so the metrics' label values, small and fixed by the operator.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["ThreadClass", "ROLE_TARGETS", "SHARE_NAMES", "MAX_CLASSES", "MAX_PATTERNS", "MAX_PATTERN_LEN",
           "builtin_role", "role_of", "carve", "parse_thread_classes", "class_names"]

ROLE_TARGETS = ("main", "acl", "release")
SHARE_NAMES = {
    "all": (Fraction(0), Fraction(1)),
    "first-half": (Fraction(0), Fraction(1, 2)),
    "second-half": (Fraction(1, 2), Fraction(1)),
    "first-quarter": (Fraction(0), Fraction(1, 4)),
    "last-quarter": (Fraction(3, 4), Fraction(1)),
}
MAX_CLASSES = 16
MAX_PATTERNS = 8
MAX_PATTERN_LEN = 32
# names a plan or a metric already uses for something else
_RESERVED = frozenset({"main", "acl", "release", "pool", "irq", "uvb", "numa_nodes", "classes"})
_NAME = re.compile(r"[a-z][a-z0-9_]{0,23}")
_PATTERN_CHARS = re.compile(r"[ -~]+")
_MAX_DENOMINATOR = 1024


@dataclass(frozen=True)
class ThreadClass:
    """One row of ``thread_classes``: threads whose comm matches one of ``patterns``
    go to ``role``, or (``role`` None) to the ``share`` span of main."""

    name: str
    patterns: tuple[str, ...]
    role: str | None = None
    share: tuple[Fraction, Fraction] | None = None

    def matches(self, comm: str) -> bool:
        return _matcher(self.patterns)(comm) is not None

    @property
    def target(self) -> str:
        """Where its threads go: a role name, or the class's own name for a share."""
        return self.role if self.role is not None else self.name

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "match": list(self.patterns)}
        if self.role is not None:
            out["role"] = self.role
        else:
            assert self.share is not None
            out["share"] = [str(self.share[0]), str(self.share[1])]
        return out

    @classmethod
    def from_json(cls, d: Any) -> ThreadClass:
        return parse_thread_classes([d])[0]


@functools.lru_cache(maxsize=256)
def _matcher(patterns: tuple[str, ...]):
    """One compiled regular expression for a class's patterns (fnmatch, case sensitive)."""
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


def builtin_role(comm: str) -> str:
    """The built-in rules: ``acl_thread*`` -> acl, ``release_thread*`` -> release, else main."""
    if comm.startswith("acl_thread"):
        return "acl"
    if comm.startswith("release_thread"):
        return "release"
    return "main"


def role_of(comm: str, classes: Sequence[ThreadClass] = ()) -> str:
    """Where the thread named ``comm`` goes: the target of the first class that matches
    (a role, or a share class's name), else the built-in rules."""
    for c in classes:
        if _matcher(c.patterns)(comm) is not None:
            return c.role if c.role is not None else c.name
    return builtin_role(comm)


def class_names(classes: Iterable[ThreadClass]) -> tuple[str, ...]:
    """The share classes' names, in config order: the targets beyond the three roles."""
    return tuple(c.name for c in classes if c.role is None)


def carve(main: Sequence[int], share: tuple[Fraction, Fraction]) -> tuple[int, ...]:
    """The CPUs of ``main`` (sorted) at positions ``floor(from*n)`` to ``floor(to*n)``; one
    CPU when that rounds to none (see the module's rounding rule); () for an empty main."""
    cpus = sorted(main)
    n = len(cpus)
    if n == 0:
        return ()
    lo, hi = math.floor(share[0] * n), math.floor(share[1] * n)
    if hi <= lo:
        lo = min(lo, n - 1)
        hi = lo + 1
    return tuple(cpus[lo:hi])


# ---------------------------------------------------------------- the config key


def parse_thread_classes(value: Any) -> tuple[ThreadClass, ...]:
    """The ``thread_classes`` value checked: a TOML array of tables (``name``, ``match``,
    and ``role`` or ``share``), or its text form from a variable or flag,
    ``name:pattern[,pattern]:target`` entries separated by ``;``. ValueError with a
    sentence naming the entry otherwise. A tuple of ThreadClass comes back as is."""
    if isinstance(value, tuple) and all(isinstance(c, ThreadClass) for c in value):
        return value
    if isinstance(value, str):
        value = _from_text(value)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected an array of tables (name, match, role or share), got {type(value).__name__}")
    if len(value) > MAX_CLASSES:
        raise ValueError(f"{len(value)} classes; at most {MAX_CLASSES}")
    out: list[ThreadClass] = []
    for i, entry in enumerate(value):
        c = _one_class(i, entry)
        if any(o.name == c.name for o in out):
            raise ValueError(f"class {i + 1}: name {c.name!r} is used twice")
        out.append(c)
    return tuple(out)


def _from_text(text: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        fields = part.split(":")
        if len(fields) != 3:
            raise ValueError(f"entry {part[:80]!r} is not name:pattern[,pattern]:target "
                             f"(target: main, acl, release or a share such as second-half or 1/4)")
        name, patterns, target = (f.strip() for f in fields)
        entry: dict[str, Any] = {"name": name, "match": [p.strip() for p in patterns.split(",")]}
        entry["role" if target in ROLE_TARGETS else "share"] = target
        entries.append(entry)
    return entries


def _one_class(i: int, entry: Any) -> ThreadClass:
    where = f"class {i + 1}"
    if isinstance(entry, ThreadClass):
        entry = entry.to_json()
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a table with name, match and role or share, got {entry!r:.80}")
    extra = set(entry) - {"name", "match", "role", "share"}
    if extra:
        raise ValueError(f"{where}: unknown field {sorted(extra)[0]!r} (fields: name, match, role, share)")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _RESERVED:
        raise ValueError(f"{where}: name {name!r:.40} must be 1 to 24 of a-z, 0-9, _ starting with a letter, "
                         f"and not one of {', '.join(sorted(_RESERVED))}")
    where = f"class {name!r}"
    patterns = entry.get("match")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{where}: match must be a pattern or a non-empty list of patterns")
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"{where}: {len(patterns)} patterns; at most {MAX_PATTERNS}")
    for p in patterns:
        if not 1 <= len(p) <= MAX_PATTERN_LEN or not _PATTERN_CHARS.fullmatch(p):
            raise ValueError(f"{where}: pattern {p[:40]!r} must be 1 to {MAX_PATTERN_LEN} printable ASCII "
                             f"characters (it matches a thread name of at most 15)")
    role, share = entry.get("role"), entry.get("share")
    if (role is None) == (share is None):
        raise ValueError(f"{where}: give exactly one of role ({', '.join(ROLE_TARGETS)}) or share")
    if role is not None:
        if role not in ROLE_TARGETS:
            raise ValueError(f"{where}: role must be one of {', '.join(ROLE_TARGETS)}; got {role!r:.40}")
        return ThreadClass(name, tuple(patterns), role=role)
    return ThreadClass(name, tuple(patterns), share=_share(where, share))


def _share(where: str, value: Any) -> tuple[Fraction, Fraction]:
    """``"second-half"`` (a name of SHARE_NAMES), one fraction ``f`` (the last ``f`` of
    main: ``"1/4"``, 0.25), or ``[from, to]`` with 0 <= from < to <= 1."""
    if isinstance(value, str) and value.strip() in SHARE_NAMES:
        return SHARE_NAMES[value.strip()]
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"{where}: share [from, to] takes two fractions; got {len(value)}")
        lo, hi = _fraction(where, value[0]), _fraction(where, value[1])
    else:
        size = _fraction(where, value)
        lo, hi = 1 - size, Fraction(1)
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"{where}: share must be a span of main with 0 <= from < to <= 1; got {lo} to {hi}")
    return lo, hi


def _fraction(where: str, value: Any) -> Fraction:
    names = ", ".join(SHARE_NAMES)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{where}: share must be one of {names}, a fraction or [from, to]; got {value!r:.40}")
    try:
        f = Fraction(str(value).strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{where}: share must be one of {names}, a fraction such as 1/4 or 0.25, "
                         f"or [from, to]; got {value!r:.40}") from None
    if f.denominator > _MAX_DENOMINATOR or not 0 <= f <= 1:
        raise ValueError(f"{where}: share fraction {value!r:.40} must be from 0 to 1 with a denominator "
                         f"of at most {_MAX_DENOMINATOR}")
    return f
