"""Placement that knows where the bytes are (meshd/plan/assignment.py rule 4): among windows of the
same length in the target, the one the joiner already holds, then the one most peers serve; never
at the cost of coverage."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.plan.adverts import CoverageMap, Span, holder_counts
from meshd.plan.assignment import JoinRequest, ModelFootprint, plan_join
from meshd.plan.errors import PlanInputError
from tests._planner_helpers import MODEL, make_ad

FP = ModelFootprint.uniform(MODEL, 8, 100)


def cov(ranges, n=8):
    ads = [make_ad(f"p{i}", s, e, n) for i, (s, e) in enumerate(ranges)]
    return CoverageMap.build(ads, model_digest=MODEL, num_layers=n)


def test_a_range_already_held_wins_over_the_leftmost():
    empty = cov([])
    assert plan_join(empty, FP, JoinRequest("n", 300, 0)).span == Span(0, 3)
    assert plan_join(empty, FP, JoinRequest("n", 300, 0, prefer=Span(4, 8))).span == Span(4, 7)
    assert plan_join(empty, FP, JoinRequest("n", 300, 0, prefer=Span(6, 8))).span == Span(5, 8)


def test_then_the_layers_most_peers_serve():
    holders = (0, 0, 1, 1, 3, 3, 3, 2)
    assert plan_join(cov([]), FP, JoinRequest("n", 300, 0), holders=holders).span == Span(4, 7)
    # held beats popular
    plan = plan_join(cov([]), FP, JoinRequest("n", 300, 0, prefer=Span(0, 2)), holders=holders)
    assert plan.span == Span(0, 3)


def test_coverage_comes_first():
    # the gap is 3..8: a joiner that holds 0..3 still goes to the gap
    plan = plan_join(cov([(0, 3)]), FP, JoinRequest("n", 300, 0, prefer=Span(0, 3)),
                     holders=(9, 9, 9, 0, 0, 0, 0, 0))
    assert plan.span == Span(3, 6)


def test_holder_counts_from_records():
    ads = [make_ad("a", 0, 4, held_start=0, held_end=8, fetchable=True),   # a whole file
           make_ad("b", 4, 8, fetchable=True),                              # its range only
           make_ad("c", 0, 8)]                                              # no fetch port
    assert holder_counts(ads, 8) == (1, 1, 1, 1, 2, 2, 2, 2)
    with pytest.raises(PlanInputError):
        plan_join(cov([]), FP, JoinRequest("n", 300, 0), holders=(1, 2))


@given(st.integers(1, 8), st.integers(0, 7), st.integers(1, 8),
       st.lists(st.integers(0, 5), min_size=8, max_size=8), st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8))))
@settings(max_examples=200)
def test_the_preference_never_changes_the_target_or_the_length(mem_layers, p0, p1, holders, ranges):
    ranges = [(s, e) for s, e in ranges if s < e][:4]
    prefer = Span(min(p0, p1 - 1), max(p0 + 1, p1)) if p0 != p1 else None
    coverage = cov(ranges)
    plain = plan_join(coverage, FP, JoinRequest("n", 100 * mem_layers, 0))
    steered = plan_join(coverage, FP, JoinRequest("n", 100 * mem_layers, 0, prefer=prefer), holders=tuple(holders))
    assert steered.target == plain.target and steered.span.length == plain.span.length
    assert steered.reason == plain.reason
