"""The kubelet hint merge, table-driven: each row is one rule of the merge."""

import pytest

from ascendbind.planner.align.hints import (Hint, aggregate_score, average_distance, filter_single_numa, mask_of, merge,
                                      nodes_in)


def H(nodes, preferred=True, score=0):
    return Hint(None if nodes is None else mask_of(nodes), preferred, score)


MACHINE4 = mask_of(range(4))
# 0-1 and 2-3 are sibling pairs (20); across pairs 30; 0 and 2 are closest in DIST_02
DIST = {a: {b: 10 if a == b else (20 if a // 2 == b // 2 else 30) for b in range(4)} for a in range(4)}
DIST_02 = {0: {0: 10, 1: 30, 2: 12, 3: 30}, 1: {0: 30, 1: 10, 2: 30, 3: 12},
           2: {0: 12, 1: 30, 2: 10, 3: 30}, 3: {0: 30, 1: 12, 2: 30, 3: 10}}


@pytest.mark.parametrize("scores,expected", [
    ((0, 0, 90), 90),  # zero is "no signal", not zero utilisation
    ((40, 81), 60),  # integer division
    ((0, 0), 0),  # nobody has a signal
    ((50,), 50),
])
def test_aggregate_score_skips_zeros(scores, expected):
    assert aggregate_score([H([0], score=s) for s in scores]) == expected


def test_aggregate_score_ignores_hints_without_a_mask():
    assert aggregate_score([H(None, score=70), H([1], score=30)]) == 30


MERGE_TABLE = [
    # (rule, providers, expected nodes, expected preferred, viable)
    ("preferred when every provider agrees on one mask",
     [[H([1])], [H([1])], [H([1])]], (1,), True, True),
    ("a None mask is no opinion: it neither narrows nor breaks agreement",
     [[H(None)], [H([2])], [H([2])]], (2,), True, True),
    ("preferred only if all masks are equal, not merely overlapping",
     [[H([0])], [H([0, 1])]], (0,), False, True),
    ("preferred only if every hint is preferred",
     [[H([0])], [H([0], preferred=False)]], (0,), False, True),
    ("empty AND is rejected; with nothing viable the answer is the machine mask, not preferred",
     [[H([0])], [H([1])]], (0, 1, 2, 3), False, False),
    ("a wider viable hint beats a narrower impossible one",
     [[H([0]), H([0, 1], preferred=False)], [H([1])]], (1,), False, True),
    ("preferred beats non-preferred even when wider",
     [[H([0, 1]), H([0], preferred=False)], [H([0, 1])]], (0, 1), True, True),
    ("between preferred hints the narrowest wins",
     [[H([0, 1]), H([1])], [H(None)]], (1,), True, True),
    ("equal width: the higher aggregated score wins",
     [[H([0], score=10), H([1], score=90)], [H(None)]], (1,), True, True),
    ("equal width and score: the lower node ids win",
     [[H([3]), H([1])], [H(None)]], (1,), True, True),
    ("the machine mask is ANDed in: a hint cannot escape the host",
     [[H([0, 5])], [H(None)]], (0,), True, True),
    ("non-preferred: the width the most demanding provider needs wins (maxOfMinAffinityCounts)",
     [[H([0, 1], preferred=False)], [H([0]), H([1]), H([0, 1, 2, 3], preferred=False)]], (0, 1), False, True),
    ("a provider with no hints at all empties the product",
     [[H([0])], []], (0, 1, 2, 3), False, False),
]


@pytest.mark.parametrize("rule,providers,nodes,preferred,viable", MERGE_TABLE, ids=[r[0] for r in MERGE_TABLE])
def test_merge_rules(rule, providers, nodes, preferred, viable):
    merged, ok = merge(providers, MACHINE4)
    assert (nodes_in(merged.mask), merged.preferred, ok) == (nodes, preferred, viable)


def test_merged_score_is_the_aggregate_of_the_winning_permutation():
    merged, _ = merge([[H([1], score=40)], [H([1], score=81)], [H([1])]], MACHINE4)
    assert merged.score == 60
    assert [nodes_in(h.mask) for h in merged.permutation] == [(1,), (1,), (1,)]


def test_narrowest_vs_closest():
    providers = [[H([0, 1], score=90), H([0, 2], score=10)], [H(None)]]
    # default: narrowest (tie), then score
    merged, _ = merge(providers, MACHINE4, distances=DIST_02)
    assert nodes_in(merged.mask) == (0, 1)
    # prefer_closest_numa: equal width, so the lower average distance wins before the score
    merged, _ = merge(providers, MACHINE4, prefer_closest=True, distances=DIST_02)
    assert nodes_in(merged.mask) == (0, 2)
    # but width still comes first: a single node beats any closer pair
    providers = [[H([0, 2]), H([3])], [H(None)]]
    merged, _ = merge(providers, MACHINE4, prefer_closest=True, distances=DIST_02)
    assert nodes_in(merged.mask) == (3,)


def test_closest_ties_go_to_the_lower_node_ids():
    providers = [[H([2, 3]), H([0, 1])], [H(None)]]
    merged, _ = merge(providers, MACHINE4, prefer_closest=True, distances=DIST)
    assert nodes_in(merged.mask) == (0, 1)


def test_average_distance_counts_every_ordered_pair():
    assert average_distance(mask_of([0, 1]), DIST) == (10 + 20 + 20 + 10) / 4
    assert average_distance(mask_of([0]), DIST) == 10
    assert average_distance(mask_of([0, 9]), DIST) is None


def test_single_numa_filter_keeps_preferred_single_node_and_no_opinion_hints():
    providers = [[H([0, 1]), H([0], preferred=False), H([1])], [H(None), H(None, preferred=False)]]
    assert filter_single_numa(providers) == [[H([1])], [H(None)]]


def test_single_numa_filter_can_leave_a_provider_empty():
    merged, ok = merge(filter_single_numa([[H([0, 1])], [H([0])]]), MACHINE4)
    assert not ok and not merged.preferred


def test_no_machine_mask_means_nothing_is_viable():
    merged, ok = merge([[H([0])]], 0)
    assert not ok and merged.mask == 0


def test_product_is_pruned_not_exploded():
    # 8 providers x 8 single-node hints = 16.7M permutations without pruning
    machine = mask_of(range(8))
    providers = [[H([n]) for n in range(8)] for _ in range(8)]
    merged, ok = merge(providers, machine)
    assert ok and nodes_in(merged.mask) == (0,) and merged.preferred
