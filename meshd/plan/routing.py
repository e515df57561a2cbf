"""Route planning: the cheapest chain of hops through layers [0, n) (pure).

Graph (Dijkstra, the petals sequence-manager shape, without its state)::

    state  (layer l, peer p): activations at boundary l sit on peer p; the
           origin is (0, entry) -- the entry node holds the token ids.
    edge   from (l, p) to (q.end, q) for every live ad q with q.start <= l < q.end:
           the hop runs q over [l, q.end) -- l is its *effective start*, so
           overlapping ranges are resolved per hop and a worker never repeats
           a layer the previous hop already ran.
    cost   q.decode_ms_per_layer * (q.end - f)      measured compute, f = l -- or q.start for a
                                                    llama.cpp range, which runs its layers before l
                                                    too when entered mid-way (native/llama_engine.py)
           + rtt(p, q)                              link (rtt map, else default)
           + relay_penalty_ms   if q is relayed     (relay circuits are slower)
           + no_kv_penalty_ms   if q.free_kv_tokens < needed_tokens
           + rtt(q, entry)      if q.end == n       (the token goes back)
    goal   any state at layer n.

Determinism: ads are put in a canonical order and the heap breaks ties by
(cost, hops, layer, peer id), so equal inputs in any order give the same
route; on equal cost the route with fewer hops wins.
Every hop ends at its ad's end, so a model whose layers are all covered
always has a route; when some are not, ``MissingLayersError`` lists them.

A route never mixes runtime recipes (exactness holds only within one
numeric path): ads are grouped by recipe digest and searched per group.

``replacement_route`` keeps the hops before a failed one (their sessions and
KV stay valid) and re-plans from the failed hop's effective start, avoiding
the failed peer; the route driver re-prefills only the hops that
``hops_to_reprefill`` names.

State: none. Clock, RTTs and ads are arguments.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshd.plan.adverts import CoverageMap, ShardAd, Span, live_adverts
from meshd.plan.errors import MissingLayersError, PlanInputError
from proto import shard_runtime_pb2 as pb

# An unmeasured link is priced like a typical same-region home broadband
# round trip: not free (that would favour unknown peers) nor prohibitive.
DEFAULT_RTT_MS = 5.0
# Relay v2 measured here: ~3 ms extra RTT and ~24 MB/s; a 128-token bf16
# prefill chunk of a 4k-wide model (1 MiB) costs ~40 ms more through it.
# Per decode token the cost is a few ms, so prefer direct peers unless a
# relayed one saves more than that.
RELAY_PENALTY_MS = 10.0
# A peer without KV room refuses the session (RESOURCE_EXHAUSTED); price it
# so it is chosen only when nothing else covers the span.
NO_KV_PENALTY_MS = 10_000.0
# Bound on any cost input (RTTs, penalties): a minute is already "unusable".
MAX_COST_MS = 60_000.0

RttMap = Mapping[tuple[str, str], float]


def _check_ms(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= MAX_COST_MS:
        raise PlanInputError(f"{what}={value!r} must be a number of ms in [0, {MAX_COST_MS}]")
    return float(value)


@dataclass(frozen=True, slots=True)
class RouteCosts:
    default_rtt_ms: float = DEFAULT_RTT_MS
    relay_penalty_ms: float = RELAY_PENALTY_MS
    no_kv_penalty_ms: float = NO_KV_PENALTY_MS

    def __post_init__(self) -> None:
        _check_ms(self.default_rtt_ms, "default_rtt_ms")
        _check_ms(self.relay_penalty_ms, "relay_penalty_ms")
        _check_ms(self.no_kv_penalty_ms, "no_kv_penalty_ms")


@dataclass(frozen=True, slots=True)
class Hop:
    """One peer running ``[effective_start, end)`` of its registered ``[start, end)``."""

    peer_id: str
    start: int
    end: int
    effective_start: int
    relayed: bool
    endpoint: str = ""
    cost_ms: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise PlanInputError("hop peer_id must be a non-empty string")
        if not 0 <= self.start <= self.effective_start < self.end:
            raise PlanInputError(f"hop {self.peer_id}: need start <= effective_start < end, got "
                                 f"{self.start} <= {self.effective_start} < {self.end}")
        if not math.isfinite(self.cost_ms) or self.cost_ms < 0:
            raise PlanInputError(f"hop cost {self.cost_ms!r} must be finite and >= 0")


@dataclass(frozen=True, slots=True)
class Route:
    """Hops that run every layer of the model exactly once, in order."""

    model_digest: str
    num_layers: int
    hops: tuple[Hop, ...]
    recipe_digest: str = ""  # every hop runs this runtime recipe

    def __post_init__(self) -> None:
        if not self.hops:
            raise PlanInputError("a route needs at least one hop")
        boundary = 0
        for hop in self.hops:
            if hop.effective_start != boundary:
                raise PlanInputError(f"hop {hop.peer_id} starts at layer {hop.effective_start}, "
                                     f"the previous hop stopped at {boundary}")
            boundary = hop.end
        if boundary != self.num_layers:
            raise PlanInputError(f"route stops at layer {boundary} of {self.num_layers}")
        if len({h.peer_id for h in self.hops}) != len(self.hops):
            raise PlanInputError("a peer appears twice in one route")

    @property
    def cost_ms(self) -> float:
        return sum(h.cost_ms for h in self.hops)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(h.peer_id for h in self.hops)


def link_rtt(rtt: RttMap, a: str, b: str, default_ms: float) -> float:
    """Measured RTT between two peers in either direction, else the default."""
    if a == b:
        return 0.0
    value = rtt.get((a, b))
    if value is None:
        value = rtt.get((b, a))
    return default_ms if value is None else _check_ms(value, f"rtt({a}, {b})")


def _search(ads: tuple[ShardAd, ...], *, num_layers: int, origin: tuple[int, str], entry: str,
            rtt: RttMap, needed_tokens: int, costs: RouteCosts) -> list[Hop] | None:
    by_layer: list[list[ShardAd]] = [[] for _ in range(num_layers)]
    for ad in ads:
        for layer in range(ad.start, ad.end):
            by_layer[layer].append(ad)
    best: dict[tuple[int, str], tuple[float, int]] = {origin: (0.0, 0)}
    back: dict[tuple[int, str], tuple[tuple[int, str], Hop]] = {}
    heap: list[tuple[float, int, int, str]] = [(0.0, 0, origin[0], origin[1])]
    while heap:
        cost, hops, layer, peer = heapq.heappop(heap)
        if (cost, hops) > best[(layer, peer)]:
            continue  # stale heap entry
        if layer == num_layers:
            path: list[Hop] = []
            state = (layer, peer)
            while state != origin:
                state, hop = back[state]
                path.append(hop)
            return path[::-1]
        for q in by_layer[layer]:
            first = q.start if q.backend == pb.BACKEND_LLAMA_CPP else layer
            step = (q.decode_ms_per_layer * (q.end - first)
                    + link_rtt(rtt, peer, q.peer_id, costs.default_rtt_ms)
                    + (costs.relay_penalty_ms if q.relayed else 0.0)
                    + (costs.no_kv_penalty_ms if q.free_kv_tokens < needed_tokens else 0.0)
                    + (link_rtt(rtt, q.peer_id, entry, costs.default_rtt_ms)
                       if q.end == num_layers else 0.0))
            nxt = (q.end, q.peer_id)
            cand = (cost + step, hops + 1)
            if nxt not in best or cand < best[nxt]:
                best[nxt] = cand
                back[nxt] = ((layer, peer), Hop(q.peer_id, q.start, q.end, layer, q.relayed,
                                                q.grpc_endpoint, step))
                heapq.heappush(heap, (cand[0], cand[1], nxt[0], nxt[1]))
    return None


def _candidates(ads: Iterable[ShardAd], *, model_digest: str, num_layers: int, now_ms: int,
                avoid: frozenset[str]) -> tuple[ShardAd, ...]:
    return tuple(ad for ad in live_adverts(ads, model_digest=model_digest, now_ms=now_ms)
                 if ad.num_layers == num_layers and ad.peer_id not in avoid)


def _missing(cands: Iterable[ShardAd], model_digest: str, num_layers: int, from_layer: int,
             avoid: frozenset[str], recipe_digest: str) -> MissingLayersError:
    gaps = CoverageMap.build(cands, model_digest=model_digest, num_layers=num_layers).gaps()
    spans = [Span(max(g.start, from_layer), g.end) for g in gaps if g.end > from_layer]
    return MissingLayersError(spans, model_digest=model_digest, num_layers=num_layers,
                              excluded=sorted(avoid), recipe_digest=recipe_digest)


def _plan(cands: tuple[ShardAd, ...], *, model_digest: str, num_layers: int,
          recipe_digest: str | None, origin: tuple[int, str], entry: str, rtt: RttMap,
          needed_tokens: int, costs: RouteCosts, avoid: frozenset[str]) -> tuple[str, list[Hop]]:
    """Cheapest hops from ``origin`` that never mix runtime recipes.

    Ads are grouped by recipe digest (only ``recipe_digest``'s group when it
    is given); each group is searched alone and the cheapest route wins (ties:
    fewer hops, then the smaller digest). With no route in any group, the
    error lists the layers missing in the group that comes closest.
    """
    groups: dict[str, list[ShardAd]] = {}
    for ad in cands:
        if recipe_digest is None or ad.recipe_digest == recipe_digest:
            groups.setdefault(ad.recipe_digest, []).append(ad)
    found = []
    for recipe in sorted(groups):
        hops = _search(tuple(groups[recipe]), num_layers=num_layers, origin=origin, entry=entry,
                       rtt=rtt, needed_tokens=needed_tokens, costs=costs)
        if hops is not None:
            found.append((sum(h.cost_ms for h in hops), len(hops), recipe, hops))
    if found:
        _, _, recipe, hops = min(found, key=lambda f: f[:3])
        return recipe, hops
    errors = [_missing(groups[r], model_digest, num_layers, origin[0], avoid, r) for r in sorted(groups)]
    if not errors:
        errors = [_missing((), model_digest, num_layers, origin[0], avoid, recipe_digest or "")]
    raise min(errors, key=lambda e: sum(span.length for span in e.spans))


def plan_route(ads: Iterable[ShardAd], *, model_digest: str, num_layers: int, now_ms: int,
               entry_peer_id: str, rtt: RttMap | None = None, needed_tokens: int = 0,
               costs: RouteCosts = RouteCosts(), avoid: Iterable[str] = (),
               recipe_digest: str | None = None) -> Route:
    """Cheapest route over the live ads of one model; ``MissingLayersError`` if none.

    ``recipe_digest`` pins the runtime recipe (the entry passes its own);
    without it the cheapest single-recipe route is chosen.
    """
    if not 1 <= num_layers or not entry_peer_id or needed_tokens < 0:
        raise PlanInputError("plan_route needs num_layers >= 1, an entry peer id, needed_tokens >= 0")
    gone = frozenset(avoid)
    cands = _candidates(ads, model_digest=model_digest, num_layers=num_layers, now_ms=now_ms, avoid=gone)
    recipe, hops = _plan(cands, model_digest=model_digest, num_layers=num_layers,
                         recipe_digest=recipe_digest, origin=(0, entry_peer_id), entry=entry_peer_id,
                         rtt=rtt or {}, needed_tokens=needed_tokens, costs=costs, avoid=gone)
    return Route(model_digest, num_layers, tuple(hops), recipe)


def replacement_route(route: Route, failed_peer: str, ads: Iterable[ShardAd], *, now_ms: int,
                      entry_peer_id: str, rtt: RttMap | None = None, needed_tokens: int = 0,
                      costs: RouteCosts = RouteCosts(), avoid: Iterable[str] = ()) -> Route:
    """Re-plan ``route`` after ``failed_peer`` died, keeping the hops before it.

    The new route shares the prefix of hops that ran before the failed one;
    from the failed hop's effective start it is the cheapest continuation, in
    the route's runtime recipe, that uses neither the failed peer, nor
    ``avoid`` (earlier failures), nor a prefix peer again.
    """
    index = next((i for i, h in enumerate(route.hops) if h.peer_id == failed_peer), None)
    if index is None:
        raise PlanInputError(f"{failed_peer!r} is not a hop of this route ({', '.join(route.peers)})")
    prefix = route.hops[:index]
    gone = frozenset(avoid) | {failed_peer}
    used = {h.peer_id for h in prefix}
    cands = tuple(ad for ad in _candidates(ads, model_digest=route.model_digest,
                                           num_layers=route.num_layers, now_ms=now_ms, avoid=gone)
                  if ad.peer_id not in used)
    origin = (route.hops[index].effective_start, prefix[-1].peer_id if prefix else entry_peer_id)
    recipe, hops = _plan(cands, model_digest=route.model_digest, num_layers=route.num_layers,
                         recipe_digest=route.recipe_digest, origin=origin, entry=entry_peer_id,
                         rtt=rtt or {}, needed_tokens=needed_tokens, costs=costs, avoid=gone)
    return Route(route.model_digest, route.num_layers, prefix + tuple(hops), recipe)


def hops_to_reprefill(old: Route, new: Route) -> tuple[int, ...]:
    """Indices of ``new``'s hops that need a fresh session (and a re-prefill).

    A hop of ``new`` equal in peer, range and effective start to a hop of
    ``old`` keeps its session and KV; every other hop is opened anew and fed
    the token history by the route driver.
    """
    kept = {(h.peer_id, h.start, h.end, h.effective_start) for h in old.hops}
    return tuple(i for i, h in enumerate(new.hops)
                 if (h.peer_id, h.start, h.end, h.effective_start) not in kept)
