"""Coverage-first assignment: fill the largest gap, then the weakest span, within memory."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.plan.adverts import CoverageMap, Span
from meshd.plan.assignment import (
    AssignmentReason,
    DirectiveIntent,
    JoinRequest,
    ModelFootprint,
    plan_join,
)
from meshd.plan.errors import NoFitError, PlanInputError, PlanningError
from proto import shard_runtime_pb2 as pb
from tests._planner_helpers import MODEL, make_ad, swarms

LOAD, DROP = pb.DIRECTIVE_ACTION_LOAD_SHARD, pb.DIRECTIVE_ACTION_DROP_SHARD
FP = ModelFootprint.uniform(MODEL, 8, 100)


def cov(ranges, n=8, peers=None):
    ads = [make_ad(peers[i] if peers else f"p{i}", s, e, n) for i, (s, e) in enumerate(ranges)]
    return CoverageMap.build(ads, model_digest=MODEL, num_layers=n)


@pytest.mark.parametrize("ranges, memory, span, reason", [
    ([], 1000, (0, 8), "fill_gap"),                       # a big node takes the whole model
    ([], 350, (0, 3), "fill_gap"),
    ([(0, 3)], 350, (3, 6), "fill_gap"),
    ([(0, 2), (4, 5)], 250, (5, 7), "fill_gap"),         # largest gap first, leftmost window
    ([(0, 3), (5, 8)], 150, (3, 4), "fill_gap"),
    ([(0, 2), (4, 5)], 10_000, (0, 8), "fill_gap"),      # whole gap + memory left: grows
    ([(0, 3), (5, 8)], 400, (3, 7), "fill_gap"),         # grows right on a redundancy tie
    ([(0, 8)], 300, (0, 3), "add_redundancy"),
    ([(0, 8), (0, 5)], 300, (5, 8), "add_redundancy"),   # weakest span
    ([(0, 8), (0, 5)], 500, (3, 8), "add_redundancy"),   # then towards fewer servers
    ([(0, 8), (0, 2), (6, 8)], 400, (2, 6), "add_redundancy"),
])
def test_join_table(ranges, memory, span, reason):
    plan = plan_join(cov(ranges), FP, JoinRequest("new", memory, kv_budget_tokens=0))
    assert plan.span == Span(*span)
    assert plan.reason == AssignmentReason(reason)
    assert plan.needed_bytes == 100 * plan.span.length <= memory
    assert plan.intents == (DirectiveIntent(LOAD, "new", plan.span),)


def test_kv_budget_and_head_tail_extras_count_against_memory():
    fp = ModelFootprint(MODEL, (100,) * 8, head_extra_bytes=1000, tail_extra_bytes=500,
                        kv_bytes_per_token_layer=2)
    assert fp.range_bytes(0, 8, 10) == 800 + 1000 + 500 + 160
    assert fp.range_bytes(2, 4, 10) == 240
    plan = plan_join(cov([]), fp, JoinRequest("new", 400, kv_budget_tokens=25))
    assert plan.span == Span(1, 3) and plan.needed_bytes == 300   # layer 0 carries embeddings
    plan = plan_join(cov([(0, 6)]), fp, JoinRequest("new", 650, kv_budget_tokens=0))
    assert plan.span == Span(6, 7)                                 # the tail carries lm_head


def test_a_node_too_small_for_the_gap_gets_told_how_much_is_needed():
    with pytest.raises(NoFitError, match=r"needs at least 150B.*--memory") as info:
        plan_join(cov([(0, 4)]), ModelFootprint.uniform(MODEL, 8, 100, kv_bytes_per_token_layer=1),
                  JoinRequest("tiny", 120, kv_budget_tokens=50))
    assert isinstance(info.value, PlanningError)
    assert "coverage gap 4..7" in str(info.value)


def test_a_serving_node_is_planned_without_its_own_advert():
    coverage = cov([(0, 3), (3, 8)], peers=["x", "y"])
    same = plan_join(coverage, FP, JoinRequest("x", 300, 0), current=Span(0, 3))
    assert same.reason == AssignmentReason.UNCHANGED and same.intents == ()
    moved = plan_join(coverage, FP, JoinRequest("x", 200, 0), current=Span(0, 3))
    assert moved.span == Span(0, 2)
    assert moved.intents == (DirectiveIntent(DROP, "x", Span(0, 3)), DirectiveIntent(LOAD, "x", Span(0, 2)))


@pytest.mark.parametrize("call", [
    lambda: plan_join(cov([], n=4), FP, JoinRequest("a", 10)),
    lambda: plan_join(CoverageMap.build([], model_digest="sha256:x", num_layers=8), FP, JoinRequest("a", 10)),
    lambda: JoinRequest("", 10), lambda: JoinRequest("a", -1), lambda: JoinRequest("a", 1, 1 << 30),
    lambda: ModelFootprint(MODEL, ()), lambda: ModelFootprint(MODEL, (1, -1)),
    lambda: ModelFootprint(MODEL, [1, 2]), lambda: FP.range_bytes(3, 3, 0),
    lambda: DirectiveIntent(pb.DIRECTIVE_ACTION_UNSPECIFIED, "a", Span(0, 1)),
])
def test_misuse_is_a_local_error(call):
    with pytest.raises(PlanInputError):
        call()


@settings(max_examples=300, deadline=None)
@given(swarms(max_layers=12), st.data())
def test_join_never_exceeds_memory_and_is_coverage_first(swarm, data):
    n, ads = swarm
    weights = tuple(data.draw(st.lists(st.integers(1, 500), min_size=n, max_size=n)))
    fp = ModelFootprint(MODEL, weights, head_extra_bytes=data.draw(st.integers(0, 300)),
                        tail_extra_bytes=data.draw(st.integers(0, 300)),
                        kv_bytes_per_token_layer=data.draw(st.integers(0, 3)))
    request = JoinRequest("joiner", data.draw(st.integers(0, 6000)), data.draw(st.integers(0, 64)))
    coverage = CoverageMap.build(ads, model_digest=MODEL, num_layers=n)
    target, count = coverage.weakest_span()
    try:
        plan = plan_join(coverage, fp, request)
    except NoFitError:
        assert all(fp.range_bytes(layer, layer + 1, request.kv_budget_tokens) > request.memory_bytes
                   for layer in range(target.start, target.end))
        return
    assert plan.needed_bytes == fp.range_bytes(plan.span.start, plan.span.end, request.kv_budget_tokens)
    assert plan.needed_bytes <= request.memory_bytes
    assert plan.target == target
    assert plan.reason == (AssignmentReason.FILL_GAP if count == 0 else AssignmentReason.ADD_REDUNDANCY)
    inside = Span(max(plan.span.start, target.start), min(plan.span.end, target.end))
    assert inside.start < inside.end  # it always works on the target span
    longest_fit = max(e - s for s in range(target.start, target.end)
                      for e in range(s + 1, target.end + 1)
                      if fp.range_bytes(s, e, request.kv_budget_tokens) <= request.memory_bytes)
    assert inside.length == longest_fit


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.lists(st.integers(1, 8), min_size=1, max_size=40))
def test_repeated_joins_cover_the_model_before_adding_redundancy(n, capacities):
    fp = ModelFootprint.uniform(MODEL, n, 100)
    ads = []
    for i, cap in enumerate(capacities):
        coverage = CoverageMap.build(ads, model_digest=MODEL, num_layers=n)
        plan = plan_join(coverage, fp, JoinRequest(f"n{i:02d}", cap * 100, 0))
        gaps_before = sum(g.length for g in coverage.gaps())
        ads.append(make_ad(f"n{i:02d}", plan.span.start, plan.span.end, n))
        gaps_after = sum(g.length for g in CoverageMap.build(ads, model_digest=MODEL, num_layers=n).gaps())
        if gaps_before:
            assert gaps_after <= gaps_before - min(cap, gaps_before, max(
                g.length for g in coverage.gaps()))
    total = sum(min(c, n) for c in capacities)
    if total >= n:
        assert CoverageMap.build(ads, model_digest=MODEL, num_layers=n).fully_covered


# ---------------------------------------------------------------- nodes holding a slice (GGUF)

@pytest.mark.parametrize("ranges, held, memory, span", [
    ([], (4, 8), 1000, (4, 8)),              # the gap is everything, but it holds 4..7 only
    ([], (2, 6), 250, (2, 4)),
    ([(0, 4)], (0, 6), 1000, (0, 6)),        # gap 4..7 clipped to 4..5, then grows left, never past 6
    ([(0, 8)], (3, 5), 1000, (3, 5)),        # redundancy inside the slice
    ([(0, 2)], (0, 1), 1000, (0, 1)),        # only layers already served: redundancy
])
def test_join_inside_the_held_slice(ranges, held, memory, span):
    plan = plan_join(cov(ranges), FP, JoinRequest("new", memory, kv_budget_tokens=0, held=Span(*held)))
    assert plan.span == Span(*span)


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8)), max_size=6), st.integers(0, 7), st.integers(1, 8),
       st.integers(50, 1200))
@settings(max_examples=300, deadline=None)
def test_a_slice_holder_is_never_assigned_outside_its_slice(ranges, a, b, memory):
    ranges = [(s, e) for s, e in ranges if s < e]
    if a >= b:
        return
    held = Span(a, b)
    try:
        plan = plan_join(cov(ranges), FP, JoinRequest("new", memory, kv_budget_tokens=0, held=held))
    except NoFitError:
        return
    assert held.start <= plan.span.start < plan.span.end <= held.end


def test_held_span_beyond_the_model_is_refused():
    with pytest.raises(PlanInputError):
        plan_join(cov([]), FP, JoinRequest("new", 1000, kv_budget_tokens=0, held=Span(4, 9)))


def test_one_batched_forwards_scratch_counts_once_per_range_and_logits_at_the_tail():
    from meshd.plan.assignment import SCRATCH_LOGIT_ROWS, SCRATCH_POSITIONS

    fp = ModelFootprint.uniform(MODEL, 4, 1000, kv_bytes_per_token_layer=10, scratch_row_bytes=7,
                                score_bytes_per_kv_token=3, logit_row_bytes=50)
    kv = 100
    scratch = SCRATCH_POSITIONS * (7 + 3 * kv)
    assert fp.scratch_bytes(kv, tail=False) == scratch
    assert fp.range_bytes(0, 1, kv) == 1000 + 10 * kv + scratch
    assert fp.range_bytes(0, 2, kv) - fp.range_bytes(0, 1, kv) == 1000 + 10 * kv    # not per layer
    assert fp.range_bytes(2, 4, kv) == 2 * (1000 + 10 * kv) + scratch + SCRATCH_LOGIT_ROWS * 50
    with pytest.raises(PlanInputError):
        ModelFootprint.uniform(MODEL, 2, 10, scratch_row_bytes=-1)
