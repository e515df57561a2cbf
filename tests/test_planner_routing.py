"""Route planning: Dijkstra over (peer, layer), effective starts, penalties, re-planning."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.benchmarks import route_plan
from meshd.plan.adverts import CoverageMap, Span
from meshd.plan.errors import MissingLayersError, PlanInputError, PlanningError
from meshd.plan.routing import (
    DEFAULT_RTT_MS,
    NO_KV_PENALTY_MS,
    RELAY_PENALTY_MS,
    Hop,
    Route,
    RouteCosts,
    hops_to_reprefill,
    link_rtt,
    plan_route,
    replacement_route,
)
from tests._planner_helpers import MODEL, make_ad, swarms

ENTRY = "entry"


def route(ads, n=8, **kwargs):
    kwargs.setdefault("entry_peer_id", ENTRY)
    kwargs.setdefault("now_ms", 0)
    return plan_route(ads, model_digest=MODEL, num_layers=n, **kwargs)


def shape(r: Route):
    return [(h.peer_id, h.effective_start, h.end) for h in r.hops]


def test_one_peer_serving_everything():
    r = route([make_ad("a", 0, 8, decode_ms_per_layer=2.0)], entry_peer_id="a")
    assert shape(r) == [("a", 0, 8)]
    assert r.cost_ms == 16.0                      # local entry: no link cost either way
    r = route([make_ad("a", 0, 8, decode_ms_per_layer=2.0)])
    assert r.cost_ms == 16.0 + 2 * DEFAULT_RTT_MS  # entry -> a, and the token back


def test_overlapping_ranges_get_an_effective_start_per_hop():
    r = route([make_ad("a", 0, 5), make_ad("b", 3, 8)])
    assert shape(r) == [("a", 0, 5), ("b", 5, 8)]
    assert (r.hops[1].start, r.hops[1].effective_start) == (3, 5)
    assert r.cost_ms == 8.0 + 3 * DEFAULT_RTT_MS


@pytest.mark.parametrize("ads, kwargs, expected", [
    # a fast chain beats one slow peer
    ([make_ad("slow", 0, 8, decode_ms_per_layer=10.0), make_ad("a", 0, 4), make_ad("b", 4, 8)],
     {}, [("a", 0, 4), ("b", 4, 8)]),
    # ... unless the links are slow
    ([make_ad("slow", 0, 8, decode_ms_per_layer=3.0), make_ad("a", 0, 4), make_ad("b", 4, 8)],
     dict(rtt={("a", "b"): 40.0, ("slow", "a"): 40.0}), [("slow", 0, 8)]),
    # a relayed twin is avoided ...
    ([make_ad("a", 0, 4), make_ad("b", 4, 8, relayed=True), make_ad("c", 4, 8)],
     {}, [("a", 0, 4), ("c", 4, 8)]),
    # ... unless it saves more than the relay penalty
    ([make_ad("a", 0, 4), make_ad("b", 4, 8, relayed=True, decode_ms_per_layer=0.1),
      make_ad("c", 4, 8, decode_ms_per_layer=5.0)], {}, [("a", 0, 4), ("b", 4, 8)]),
    # a peer without KV room is avoided while another can serve
    ([make_ad("a", 0, 4), make_ad("b", 4, 8, free_kv_tokens=10), make_ad("c", 4, 8, decode_ms_per_layer=50.0)],
     dict(needed_tokens=100), [("a", 0, 4), ("c", 4, 8)]),
    # ... and still used when nobody else can
    ([make_ad("a", 0, 4), make_ad("b", 4, 8, free_kv_tokens=10)],
     dict(needed_tokens=100), [("a", 0, 4), ("b", 4, 8)]),
    # measured RTTs steer the choice between equal peers
    ([make_ad("a", 0, 4), make_ad("b", 4, 8), make_ad("c", 4, 8)],
     dict(rtt={("a", "b"): 30.0, ("c", "a"): 1.0}), [("a", 0, 4), ("c", 4, 8)]),
    # equal costs: the smaller peer id wins, whatever the input order
    ([make_ad("c", 4, 8), make_ad("a", 0, 4), make_ad("b", 4, 8)], {}, [("a", 0, 4), ("b", 4, 8)]),
    # equal costs: fewer hops win
    ([make_ad("a", 0, 4, decode_ms_per_layer=0.0), make_ad("b", 4, 8, decode_ms_per_layer=0.0),
      make_ad("z", 0, 8, decode_ms_per_layer=0.0)], dict(costs=RouteCosts(default_rtt_ms=0.0)),
     [("z", 0, 8)]),
    # expired and avoided peers are not used
    ([make_ad("a", 0, 8, expires_at_ms=1), make_ad("b", 0, 8, decode_ms_per_layer=9.0),
      make_ad("c", 0, 8)], dict(avoid=["c"], now_ms=5), [("b", 0, 8)]),
])
def test_route_choices(ads, kwargs, expected):
    assert shape(route(ads, **kwargs)) == expected
    assert shape(route(list(reversed(ads)), **kwargs)) == expected


def test_penalties_are_in_the_cost():
    r = route([make_ad("a", 0, 8, relayed=True, free_kv_tokens=0)], needed_tokens=1)
    assert r.cost_ms == 8.0 + 2 * DEFAULT_RTT_MS + RELAY_PENALTY_MS + NO_KV_PENALTY_MS
    assert r.hops[0].relayed is True


def test_missing_layers_are_listed_with_what_to_do():
    with pytest.raises(MissingLayersError) as info:
        route([make_ad("a", 0, 3), make_ad("b", 4, 6)])
    err = info.value
    assert err.spans == (Span(3, 4), Span(6, 8)) and isinstance(err, PlanningError)
    assert "layer(s) 3, 6..7" in str(err) and "meshd join --layers auto" in str(err)
    with pytest.raises(MissingLayersError, match="excluding failed peers a"):
        route([make_ad("a", 0, 8)], avoid=["a"])


def test_replacement_keeps_the_prefix_and_avoids_the_failed_peer():
    ads = [make_ad("a", 0, 3), make_ad("b", 3, 6), make_ad("c", 6, 8),
           make_ad("d", 2, 7, decode_ms_per_layer=3.0), make_ad("e", 3, 8, decode_ms_per_layer=4.0)]
    r = route(ads)
    assert shape(r) == [("a", 0, 3), ("b", 3, 6), ("c", 6, 8)]
    new = replacement_route(r, "b", ads, now_ms=0, entry_peer_id=ENTRY)
    assert new.hops[0] == r.hops[0]
    assert shape(new) == [("a", 0, 3), ("d", 3, 7), ("c", 7, 8)]
    again = replacement_route(new, "d", ads, now_ms=0, entry_peer_id=ENTRY, avoid=["b"])
    assert shape(again) == [("a", 0, 3), ("e", 3, 8)]
    head = replacement_route(r, "a", ads + [make_ad("f", 0, 2)], now_ms=0, entry_peer_id=ENTRY)
    assert head.hops[0].peer_id == "f"


def test_hops_to_reprefill_names_only_changed_hops():
    ads = [make_ad("a", 0, 3), make_ad("b", 3, 6), make_ad("c", 6, 8),
           make_ad("d", 2, 7, decode_ms_per_layer=3.0), make_ad("e", 3, 6, decode_ms_per_layer=4.0)]
    r = route(ads)
    assert hops_to_reprefill(r, r) == ()
    via_d = replacement_route(r, "b", ads, now_ms=0, entry_peer_id=ENTRY)
    assert shape(via_d) == [("a", 0, 3), ("d", 3, 7), ("c", 7, 8)]
    assert hops_to_reprefill(r, via_d) == (1, 2)      # c now starts at 7: new session
    via_e = replacement_route(r, "b", ads, now_ms=0, entry_peer_id=ENTRY, avoid=["d"])
    assert hops_to_reprefill(r, via_e) == (1,)         # c keeps its session and KV


def test_routes_never_mix_runtime_recipes():
    torch_ads = [make_ad("t1", 0, 4, recipe_digest="torch"), make_ad("t2", 4, 8, recipe_digest="torch",
                                                                        decode_ms_per_layer=5.0)]
    cpp_ads = [make_ad("c1", 0, 4, recipe_digest="cpp", decode_ms_per_layer=3.0),
               make_ad("c2", 4, 8, recipe_digest="cpp")]
    r = route(torch_ads + cpp_ads)
    assert r.recipe_digest == "cpp" and shape(r) == [("c1", 0, 4), ("c2", 4, 8)]  # 16 < 24 ms
    pinned = route(torch_ads + cpp_ads, recipe_digest="torch")
    assert pinned.recipe_digest == "torch" and pinned.peers == ("t1", "t2")
    replaced = replacement_route(pinned, "t2", torch_ads + cpp_ads + [
        make_ad("t3", 2, 8, recipe_digest="torch")], now_ms=0, entry_peer_id=ENTRY)
    assert replaced.peers == ("t1", "t3") and replaced.recipe_digest == "torch"
    with pytest.raises(MissingLayersError, match="recipe cpp") as info:
        route([torch_ads[0], cpp_ads[1]])   # every layer is served, but by two recipes
    assert info.value.spans == (Span(0, 4),)  # a tie between recipes: the smaller digest
    with pytest.raises(MissingLayersError, match="recipe cpp"):
        replacement_route(r, "c2", torch_ads + cpp_ads, now_ms=0, entry_peer_id=ENTRY)


def test_replacement_reports_what_nobody_else_serves():
    ads = [make_ad("a", 0, 3), make_ad("b", 3, 6), make_ad("c", 6, 8)]
    r = route(ads)
    with pytest.raises(MissingLayersError) as info:
        replacement_route(r, "b", ads, now_ms=0, entry_peer_id=ENTRY)
    assert info.value.spans == (Span(3, 6),) and info.value.excluded == ("b",)
    with pytest.raises(PlanInputError, match="not a hop"):
        replacement_route(r, "zz", ads, now_ms=0, entry_peer_id=ENTRY)


@pytest.mark.parametrize("hops", [
    (),
    (Hop("a", 0, 4, 0, False), Hop("b", 4, 7, 4, False)),        # stops early
    (Hop("a", 0, 4, 0, False), Hop("b", 2, 8, 3, False)),        # repeats layer 3
    (Hop("a", 0, 4, 0, False), Hop("a", 4, 8, 4, False)),        # same peer twice
    (Hop("a", 1, 8, 1, False),),                                 # skips layer 0
])
def test_routes_are_validated(hops):
    with pytest.raises(PlanInputError):
        Route(MODEL, 8, hops)


@pytest.mark.parametrize("call", [
    lambda: Hop("a", 2, 4, 1, False), lambda: Hop("", 0, 1, 0, False),
    lambda: Hop("a", 0, 1, 0, False, cost_ms=math.nan), lambda: RouteCosts(default_rtt_ms=-1.0),
    lambda: link_rtt({("a", "b"): math.inf}, "a", "b", 1.0), lambda: route([], needed_tokens=-1),
])
def test_misuse_is_a_local_error(call):
    with pytest.raises(PlanInputError):
        call()


def brute_force_cost(ads, n, rtt, needed, costs):
    """Cheapest cost over every chain of hops, by exhaustive search (small inputs only)."""
    best = math.inf

    def walk(layer, peer, used, cost):
        nonlocal best
        if layer == n:
            best = min(best, cost)
            return
        for q in ads:
            if q.peer_id in used or not q.serves(layer):
                continue
            step = (q.decode_ms_per_layer * (q.end - layer)
                    + link_rtt(rtt, peer, q.peer_id, costs.default_rtt_ms)
                    + (costs.relay_penalty_ms if q.relayed else 0)
                    + (costs.no_kv_penalty_ms if q.free_kv_tokens < needed else 0)
                    + (link_rtt(rtt, q.peer_id, ENTRY, costs.default_rtt_ms) if q.end == n else 0))
            walk(q.end, q.peer_id, used | {q.peer_id}, cost + step)

    walk(0, ENTRY, frozenset(), 0.0)
    return best


rtts = st.dictionaries(st.tuples(st.sampled_from(["p00", "p01", "p02", "p03", ENTRY, "backbone-a"]),
                                 st.sampled_from(["p00", "p01", "p02", "p03", "backbone-b"])),
                       st.sampled_from([0.0, 0.5, 3.0, 20.0]), max_size=6)


@settings(max_examples=300, deadline=None)
@given(swarms(max_layers=10, max_peers=6, covered=True), rtts, st.sampled_from([0, 200, 6000]),
       st.randoms(use_true_random=False))
def test_routes_cover_the_model_optimally_in_any_input_order(swarm, rtt, needed, rnd):
    n, ads = swarm
    r = route(ads, n, rtt=rtt, needed_tokens=needed)
    boundary = 0
    by_peer = {a.peer_id: a for a in ads}
    for hop in r.hops:
        ad = by_peer[hop.peer_id]
        assert (hop.start, hop.end, hop.relayed) == (ad.start, ad.end, ad.relayed)
        assert hop.effective_start == boundary and ad.start <= hop.effective_start < ad.end
        boundary = hop.end
    assert boundary == n
    assert r.cost_ms == pytest.approx(brute_force_cost(ads, n, rtt, needed, RouteCosts()))
    shuffled = list(ads)
    rnd.shuffle(shuffled)
    assert route(shuffled, n, rtt=rtt, needed_tokens=needed) == r


@settings(max_examples=200, deadline=None)
@given(swarms(max_layers=10, max_peers=6))
def test_no_route_exactly_when_layers_are_missing(swarm):
    n, ads = swarm
    gaps = CoverageMap.build(ads, model_digest=MODEL, num_layers=n).gaps()
    if gaps:
        with pytest.raises(MissingLayersError) as info:
            route(ads, n)
        assert info.value.spans == gaps
    else:
        assert route(ads, n).hops[-1].end == n


@settings(max_examples=200, deadline=None)
@given(swarms(max_layers=10, max_peers=7, covered=True), st.data())
def test_replacement_routes_keep_the_prefix_and_skip_the_dead(swarm, data):
    n, ads = swarm
    r = route(ads, n)
    index = data.draw(st.integers(0, len(r.hops) - 1))
    failed = r.hops[index].peer_id
    try:
        new = replacement_route(r, failed, ads, now_ms=0, entry_peer_id=ENTRY)
    except MissingLayersError as err:
        left = [a for a in ads if a.peer_id not in {failed, *r.peers[:index]}]
        cov = CoverageMap.build(left, model_digest=MODEL, num_layers=n)
        assert err.spans and all(cov.redundancy(s.start) == 0 for s in err.spans)
        return
    assert new.hops[:index] == r.hops[:index]
    assert failed not in new.peers and new.hops[-1].end == n


@settings(max_examples=150, deadline=None)
@given(swarms(max_layers=8, max_peers=6, covered=True, recipes=("r1", "r2")))
def test_mixed_recipe_swarms_get_the_cheapest_single_recipe_route(swarm):
    n, ads = swarm
    r = route(ads, n)
    assert {by.recipe_digest for by in ads if by.peer_id in r.peers} == {r.recipe_digest}
    best = min(brute_force_cost([a for a in ads if a.recipe_digest == recipe], n, {}, 0, RouteCosts())
               for recipe in ("r1", "r2"))
    assert r.cost_ms == pytest.approx(best)


def test_route_plan_benchmark_returns_its_numbers():
    result = route_plan.run(quick=True, progress=None, peers=40, layers=12)
    assert {"route_plan_ms", "replacement_plan_ms", "hops", "peers", "layers"} <= set(result)
    assert result["peers"] == 40 and result["hops"] >= 1 and result["route_plan_ms"] > 0


def test_client_only_entry_pins_the_cheapest_single_recipe_route():
    """A client-only entry (meshd/generate/service.py swarm_recipe) is on no ad: the route starts at a
    remote head and pays entry -> head and tail -> entry; the recipe is that of the cheapest route the
    ads offer, and NotReady when no single recipe covers the model."""
    from types import SimpleNamespace

    from meshd.generate.service import NotReady, swarm_recipe

    live = dict(expires_at_ms=2**62)   # swarm_recipe plans at the wall clock
    ads = [make_ad("a", 0, 4, recipe_digest="r1", **live), make_ad("b", 4, 8, recipe_digest="r1", **live),
           make_ad("c", 0, 8, recipe_digest="r2", decode_ms_per_layer=10.0, **live),
           make_ad("d", 4, 8, recipe_digest="r3", **live)]
    r = route(ads, rtt={(ENTRY, "a"): 20.0, ("a", "b"): 20.0, ("b", ENTRY): 20.0})
    assert shape(r) == [("a", 0, 4), ("b", 4, 8)] and r.recipe_digest == "r1"
    assert r.cost_ms == 8 * 1.0 + 3 * 20.0       # compute plus every leg: the entry holds no layer
    swarm = SimpleNamespace(digest=MODEL, num_layers=8)
    assert swarm_recipe(swarm, ads, ENTRY) == "r1"
    with pytest.raises(NotReady, match="no single runtime recipe"):
        swarm_recipe(swarm, [ads[0], ads[3]], ENTRY)   # 0:4 on r1, 4:8 on r3: covered, but not by one recipe
