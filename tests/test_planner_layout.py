"""The pool layout (meshd/plan/layout.py): the fewest safe moves that cover, ranges in proportion to
budgets, and the shortfall when the pool cannot cover."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.plan.adverts import CoverageMap, Span
from meshd.plan.assignment import JoinRequest, ModelFootprint, plan_join
from meshd.plan.errors import NoFitError, PlanInputError
from meshd.plan.layout import (
    MIB,
    Member,
    Move,
    coverable,
    forced_move,
    gaps_of,
    members_from_ads,
    node_fixed_bytes,
    plan_layout,
    pool_shortfall,
    ready_moves,
)
from meshd.sizes import parse_size
from tests._planner_helpers import FAR_FUTURE_MS, MODEL, make_ad

FP = ModelFootprint.uniform(MODEL, 26, 100)


def m(peer: str, memory: int, span: tuple[int, int] | None = None, movable: bool = True) -> Member:
    return Member(peer, memory, Span(*span) if span else None, movable)


def apply(members, layout) -> dict[str, Span]:
    spans = {x.peer_id: x.span for x in members if x.span is not None}
    spans.update(layout.targets)
    return spans


def test_a_redundant_node_moves_into_the_gap_and_is_sized_to_it():
    members = [m("t", 1200, (0, 12), movable=False), m("w", 1000, (1, 11)), m("s", 0, (18, 26), movable=False)]
    layout = plan_layout(FP, members, 0)
    assert layout.moves == (Move("w", Span(1, 11), Span(12, 18)),) and layout.safe
    assert ready_moves(layout.moves, {x.peer_id: x.span for x in members}, 26) == layout.moves


def test_a_chain_shifts_to_make_room_and_its_moves_wait_for_their_replacements():
    """0:8, 6:14, 12:20 and a gap 20:26; a joiner of 4 layers cannot close it alone. The fewest
    moves: one node shifts right; each layer it gives up is served by the node before it."""
    members = [m("a", 800, (0, 8), movable=False), m("b", 800, (6, 14)), m("c", 800, (12, 20)), m("e", 400)]
    layout = plan_layout(FP, members, 0)
    assert layout is not None and layout.safe
    spans = apply(members, layout)
    assert not gaps_of(26, [Member(p, 0, s, movable=False) for p, s in spans.items()])
    assert len([mv for mv in layout.moves if mv.old is not None]) == 1   # one reload; the joiner is new
    served = {x.peer_id: x.span for x in members if x.span}
    first = ready_moves(layout.moves, served, 26)
    assert first   # the newcomer and the shift both give up nothing that is served only by them


def test_budgets_are_planned_proportionally():
    """0.8, 0.4 and 0.3 of the model, all new: about 8:4:3 of the layers, each at the same share."""
    members = [m("big", 2080), m("mid", 1040), m("small", 780)]
    layout = plan_layout(FP, members, 0)
    lengths = {p: s.length for p, s in layout.targets.items()}
    assert lengths == {"big": 14, "mid": 7, "small": 5}
    assert sum(lengths.values()) == 26 and layout.share < 1024


def test_a_swap_moves_one_node_at_a_time_only_when_no_safe_order_exists():
    """Every covering layout needs the two movers to trade sole copies: not safe, one forced move."""
    fp = ModelFootprint(MODEL, (91, 150, 61, 121, 78, 81, 134, 84, 64, 77, 90, 136, 112, 118, 83, 100, 104),
                        scratch_row_bytes=1)
    members = [m("n0", 641), m("m1", 1336, (15, 16)), m("m2", 624, (12, 13)), m("m3", 1148, (4, 9)),
               m("f4", 0, (9, 14), movable=False)]
    layout = plan_layout(fp, members, 0)
    assert layout is not None and not layout.safe
    served = {x.peer_id: x.span for x in members if x.span}
    todo = list(layout.moves)
    batch = ready_moves(todo, served, 17)
    while batch:
        for mv in batch:
            served[mv.peer_id] = mv.new
        todo = [mv for mv in todo if served.get(mv.peer_id) != mv.new]
        batch = ready_moves(todo, served, 17)
    assert todo   # stuck without a forced move
    assert forced_move(todo, served, 17) in todo


def test_a_short_pool_names_the_layers_and_the_node_that_covers_them():
    members = tuple(m(f"n{i}", 700 * MIB, (7 * i, 7 * i + 7), movable=i > 0) for i in range(3))
    fp = ModelFootprint.uniform(MODEL, 26, 100 * MIB, tail_extra_bytes=30 * MIB)
    assert plan_layout(fp, members, 0) is None and not coverable(fp, members, 0)
    short = pool_shortfall(fp, members, 0)
    assert short.gaps == (Span(21, 26),)
    assert short.node_bytes == 530 * MIB and short.need_bytes == 530 * MIB   # no fixed part in this footprint
    assert short.message() == ("need 530MiB more for layers 21:26: one more node with --memory 530MiB, "
                               "or raise a node's budget")
    assert parse_size(short.message().split("--memory ")[1].split(",")[0]) == short.node_bytes
    assert short.as_dict()["gaps"] == [[21, 26]]


def test_the_fixed_part_of_a_node_is_read_off_the_footprint():
    fp = ModelFootprint.uniform(MODEL, 8, 1000, scratch_row_bytes=3, score_bytes_per_kv_token=1)
    assert node_fixed_bytes(fp, 10) == fp.scratch_bytes(10, tail=False)
    assert node_fixed_bytes(ModelFootprint.uniform(MODEL, 1, 5), 0) == 0


def test_members_from_ads_pin_the_tracker_fixed_ranges_and_pending_loads():
    ads = [make_ad("t", 0, 4, memory_budget_bytes=500), make_ad("a", 4, 8, memory_budget_bytes=500),
           make_ad("f", 2, 6, memory_budget_bytes=0), make_ad("old", 0, 8, expires_at_ms=5)]
    members = members_from_ads(ads, model_digest=MODEL, num_layers=8, now_ms=10, tracker="t",
                               pending={"j": Span(6, 8), "a": Span(0, 2)})
    by = {x.peer_id: x for x in members}
    assert set(by) == {"t", "a", "f", "j"}
    assert not by["t"].movable and not by["f"].movable
    assert by["a"].loading and by["a"].span == Span(0, 2) and by["a"].memory_bytes == 500
    assert by["j"].loading and not by["j"].movable


@pytest.mark.parametrize("call", [
    lambda: Member("", 1), lambda: Member("a", -1), lambda: Member("a", True), lambda: Member("a", 1, (0, 1)),
    lambda: Member("a", 1, Span(0, 1), movable=True, loading=True), lambda: Member("a", 1, None, False, True),
    lambda: plan_layout(FP, [m("a", 1), m("a", 2)], 0), lambda: plan_layout(FP, [m("a", 1, (0, 30))], 0),
    lambda: members_from_ads([], model_digest=MODEL, num_layers=8, now_ms=0, tracker=None, pending={"x": Span(0, 9)}),
])
def test_misuse_is_a_local_error(call):
    with pytest.raises(PlanInputError):
        call()


# ---------------------------------------------------------------------- the process, as a property

def _tracker_of(spans: dict[str, Span]) -> str | None:
    heads = sorted(p for p, s in spans.items() if s.start == 0)
    return heads[0] if heads else min(spans, default=None)


def _members(spans, memory, tracker):
    return [Member(p, memory[p], s, movable=p != tracker) for p, s in sorted(spans.items())]


def _settle(fp, spans: dict[str, Span], memory: dict[str, int], n: int, lost: list, steps: int = 40) -> int:
    """The tracker's loop, instant loads: plan, make the ready moves (a forced one for a swap only)."""
    tracker = _tracker_of(spans)
    for step in range(steps):
        members = _members(spans, memory, tracker)
        layout = plan_layout(fp, members, 0)
        if layout is None or not layout.moves:
            return step
        todo = [mv for mv in layout.moves if spans.get(mv.peer_id) != mv.new]
        batch = ready_moves(todo, spans, n)
        if not batch:
            assert not layout.safe, "a safe layout always has a ready move"
            batch = (forced_move(todo, spans, n),)
        before = CoverageMap.build([make_ad(p, s.start, s.end, n) for p, s in spans.items()],
                                   model_digest=MODEL, num_layers=n)
        for mv in batch:
            spans[mv.peer_id] = mv.new
        after = CoverageMap.build([make_ad(p, s.start, s.end, n) for p, s in spans.items()],
                                  model_digest=MODEL, num_layers=n)
        dropped = [x for x in range(n) if before.counts[x] and not after.counts[x]]
        if dropped:
            lost.append((layout.safe, before.fully_covered, dropped))
    raise AssertionError(f"no convergence in {steps} steps: {spans}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])   # draws between steps
@given(st.data())
def test_joins_and_leaves_in_any_order_converge_never_drop_a_last_copy_and_cover_when_they_can(data):
    n = data.draw(st.integers(2, 24), label="layers")
    fp = ModelFootprint(MODEL, tuple(data.draw(st.lists(st.integers(50, 150), min_size=n, max_size=n))),
                        head_extra_bytes=data.draw(st.sampled_from([0, 100, 300])),
                        tail_extra_bytes=data.draw(st.sampled_from([0, 100, 300])))
    spans: dict[str, Span] = {}
    memory: dict[str, int] = {}
    lost: list = []
    for i, event in enumerate(data.draw(st.lists(st.sampled_from(["join", "join", "leave"]), min_size=1,
                                                 max_size=10), label="events")):
        if event == "leave" and spans:
            del spans[data.draw(st.sampled_from(sorted(spans)))]
        elif event == "join":
            peer = f"p{i:02d}"
            memory[peer] = data.draw(st.integers(100, 2000))
            tracker = _tracker_of(spans)
            members = _members(spans, memory, tracker)
            coverage = CoverageMap.build([make_ad(p, s.start, s.end, n) for p, s in spans.items()],
                                         model_digest=MODEL, num_layers=n)
            try:
                span = plan_join(coverage, fp, JoinRequest(peer, memory[peer], 0)).span
            except NoFitError:
                span = None
            if span is None or gaps_of(n, [*members, Member(peer, 0, span, movable=False)]):
                layout = plan_layout(fp, [*members, Member(peer, memory[peer])], 0)
                if layout is not None and peer in layout.targets:
                    span = layout.targets[peer]
            if span is None:
                continue
            spans[peer] = span
        _settle(fp, spans, memory, n, lost)
        members = _members(spans, memory, _tracker_of(spans))
        for x in members:   # every range fits its node's budget
            assert fp.range_bytes(x.span.start, x.span.end, 0) <= x.memory_bytes
        if coverable(fp, members, 0):
            assert not gaps_of(n, members), f"the pool can cover but does not: {spans}"
        else:
            assert pool_shortfall(fp, tuple(members), 0) is not None
    # a last copy is dropped only by a swap (no safe layout), and never while the model was covered
    assert all(not safe and not was_covered for safe, was_covered, _ in lost), lost


def test_a_far_future_ad_is_a_member_until_it_expires():
    ad = make_ad("x", 0, 3, memory_budget_bytes=10)
    assert members_from_ads([ad], model_digest=MODEL, num_layers=8, now_ms=FAR_FUTURE_MS - 1, tracker=None)
    assert not members_from_ads([ad], model_digest=MODEL, num_layers=8, now_ms=FAR_FUTURE_MS, tracker=None)
