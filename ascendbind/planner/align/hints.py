"""NUMA hints and their merge, after the kubelet Topology Manager.

A *hint* is a NUMA bitmask (bit n = node n; ``None`` = "no opinion"), a
``preferred`` flag and a ``score`` (0 = no signal, never "zero utilisation").
Each provider (device, cpu, memory) offers a list of hints; the merge:

* walks the Cartesian product of the providers' lists (one hint from each);
* ANDs the masks of a permutation with the machine mask; the result is
  *preferred* only if every hint is preferred and every non-None mask is the
  same mask;
* rejects empty results (no node satisfies everyone) — a wider viable hint
  beats a narrower impossible one;
* keeps the best by: preferred over non-preferred, then fewer nodes (for two
  non-preferred hints, kubelet's rule: the width of the provider that needs
  the most nodes — the widest of each provider's narrowest hint — first), then
  (``prefer_closest`` and not single-numa-node) the lower average NUMA
  distance, then the higher aggregated score, then the lower node ids;
* with no viable permutation at all, the answer is the machine mask, not
  preferred (kubelet's default hint).

Aggregated score: the integer mean of the scores of hints that have a mask
and a non-zero score ({0, 0, 90} -> 90; {40, 81} -> 60); 0 when none do.

``single-numa-node`` first filters every provider to its preferred hints with
no mask or exactly one node, as kubelet's ``filterSingleNumaHints`` does; a
provider left with nothing makes the product empty.

The product is pruned as it is built: once a partial AND is empty, no
permutation below it can be viable, so it is not enumerated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from ...values.cpulist import bits

__all__ = ["Hint", "Merged", "mask_of", "nodes_in", "width", "merge", "filter_single_numa",
           "aggregate_score", "average_distance", "mask_text"]


def mask_of(nodes) -> int:
    m = 0
    for n in nodes:
        m |= 1 << n
    return m


@lru_cache(maxsize=4096)
def _nodes_in(mask: int) -> tuple[int, ...]:
    return bits(mask)


def nodes_in(mask: int | None) -> tuple[int, ...]:
    return () if mask is None else _nodes_in(mask)


def width(mask: int | None) -> int:
    return 0 if mask is None else bin(mask).count("1")  # int.bit_count is 3.10


def mask_text(mask: int | None) -> str:
    if mask is None:
        return "any"
    from ...values.cpulist import format_cpulist

    return "NUMA " + (format_cpulist(nodes_in(mask)) or "(none)")


@dataclass(frozen=True)
class Hint:
    mask: int | None  # None: no NUMA preference
    preferred: bool
    score: int = 0  # 0: no signal
    note: str = ""  # why the provider offers it, for explain

    def to_json(self, npu: int | None = None) -> dict:
        nodes = None if self.mask is None else list(_nodes_in(self.mask))
        if npu is None:
            return {"numa_nodes": nodes, "preferred": self.preferred, "score": self.score}
        return {"npu": npu, "numa_nodes": nodes, "preferred": self.preferred, "score": self.score}


@dataclass(frozen=True)
class Merged:
    mask: int
    preferred: bool
    score: int
    permutation: tuple[Hint, ...]  # the winning hint of each provider, in provider order; () for the default


def aggregate_score(permutation: Sequence[Hint]) -> int:
    scores = [h.score for h in permutation if h.mask is not None and h.score > 0]
    return sum(scores) // len(scores) if scores else 0


def average_distance(mask: int, distances: Mapping[int, Mapping[int, int]]) -> Fraction | None:
    """Mean distance over every ordered pair of the mask's nodes (kubelet CalculateAverageFor)."""
    nodes = nodes_in(mask)
    total = 0
    for a in nodes:
        row = distances.get(a)
        if row is None:
            return None
        for b in nodes:
            if b not in row:
                return None
            total += row[b]
    return Fraction(total, len(nodes) ** 2) if nodes else None


def _width_rank(w: int, preferred: bool, target: int) -> tuple[int, int]:
    """Preferred hints: narrower is better. Non-preferred: kubelet's best-non-preferred
    rule — a width equal to ``target`` (the widest of the providers' narrowest hints)
    first, then narrower ones widest first, then wider ones narrowest first."""
    if preferred or w == target:
        return (0, w)
    return (1, -w) if w < target else (2, w)


def _better(cand: Merged, best: Merged, closest: Callable[[int], Fraction | None] | None,
            target: int = 0) -> bool:
    """True if ``cand`` should replace ``best`` (the ordering in the module docstring)."""
    if cand.preferred != best.preferred:
        return cand.preferred
    rc = _width_rank(width(cand.mask), cand.preferred, target)
    rb = _width_rank(width(best.mask), best.preferred, target)
    if rc != rb:
        return rc < rb
    if closest is not None and cand.mask != best.mask:
        dc, db = closest(cand.mask), closest(best.mask)
        if dc is not None and db is not None and dc != db:
            return dc < db
    if cand.score != best.score:
        return cand.score > best.score
    # equal masks and scores: keep the current one, as kubelet does
    return nodes_in(cand.mask) < nodes_in(best.mask)


def filter_single_numa(providers: Sequence[Sequence[Hint]]) -> list[list[Hint]]:
    return [[h for h in hints if h.preferred and (h.mask is None or width(h.mask) == 1)] for hints in providers]


def merge(providers: Sequence[Sequence[Hint]], machine_mask: int, *, prefer_closest: bool = False,
          distances: Mapping[int, Mapping[int, int]] | None = None) -> tuple[Merged, bool]:
    """Best merged hint over the providers' Cartesian product, and whether any permutation was viable.

    ``providers`` is one list per provider; an empty list is "this provider
    can offer nothing", which empties the product (callers give a provider
    without an opinion ``[Hint(None, True)]``).
    """
    closest: Callable[[int], Fraction | None] | None = None
    if prefer_closest and distances:
        cache: dict[int, Fraction | None] = {}

        def avg(mask: int) -> Fraction | None:
            if mask not in cache:
                cache[mask] = average_distance(mask, distances)
            return cache[mask]

        closest = avg

    # kubelet's maxOfMinAffinityCounts: the provider that needs the most nodes sets the
    # width a non-preferred answer should have
    target = max((min((width(h.mask) for h in hints if h.mask is not None), default=0) for hints in providers),
                 default=0)
    best: Merged | None = None
    n = len(providers)
    chosen: list[Hint] = []

    def walk(i: int, acc: int, preferred: bool, first: int | None) -> None:
        nonlocal best
        if i == n:
            cand = Merged(mask=acc, preferred=preferred, score=aggregate_score(chosen), permutation=tuple(chosen))
            if best is None or _better(cand, best, closest, target):
                best = cand
            return
        for hint in providers[i]:
            if hint.mask is None:
                nxt, pref, f = acc, preferred and hint.preferred, first
            else:
                nxt = acc & hint.mask
                if not nxt:
                    continue  # empty AND: nothing below this can be viable
                f = hint.mask if first is None else first
                pref = preferred and hint.preferred and hint.mask == f
            chosen.append(hint)
            walk(i + 1, nxt, pref, f)
            chosen.pop()

    if machine_mask:
        walk(0, machine_mask, True, None)
    if best is None:
        return Merged(mask=machine_mask, preferred=False, score=0, permutation=()), False
    return best, True
