"""Pool layout: where the auto nodes' ranges go so the pool covers the model, and how short it is (pure).

Data flow::

    live ShardAds + the tracker's pending loads (meshd/swarm/tracker_duty.py)
        -> members_from_ads()   Member(peer, budget, span, movable, loading) per node
        -> plan_layout()        Layout: the moves that make the pool cover every layer, or None
        -> ready_moves()        the moves that are safe now (LOAD before DROP)
        -> pool_shortfall()     Shortfall: the layers without a server and the memory missing, or None

Rules (coverage first, then as little churn as possible):

1. Who moves. A *movable* member is an auto node that advertises its budget
   (a whole-file ``--layers auto`` node), is not the tracker (it plans; moving
   it would move duty mid-plan) and is not loading an assignment. Everyone
   else is *pinned*: fixed ``--layers A:B`` nodes, slice holders (they
   advertise no budget), the tracker, and nodes still loading; their layers
   count as covered.
2. The fewest movers. Nodes with no range yet (a joiner) always take part:
   placing them reloads nothing. Among the nodes that serve, sets of movers
   are tried in increasing size, the cheapest first (the fewest layers only
   they serve, then by peer id); the first set that covers every layer, with
   moves that can be ordered safely (rule 4), wins. After ``MAX_MOVER_SETS``
   sets, every movable member moves.
3. Proportional ranges. The movers are laid left to right over the layers
   the others leave uncovered (in the order of their current ranges,
   newcomers last; then largest budget first, then smallest; with at most
   ``MAX_PERMUTED`` movers, every order). Each takes the longest range starting at the first
   uncovered layer whose footprint fits ``share`` of its budget, with the
   smallest share (in 1/``SHARE_STEPS``) that still covers: ranges in
   proportion to the budgets (0.8, 0.4 and 0.3 of the model get about
   8:4:3 of the layers), and every mover keeps the same headroom.
4. Safe moves. A node serves one range; moving it restarts its worker on the
   new range. A move is made only when every layer it gives up (old minus
   new) is served by another node that is not moving now: the replacement
   serves first (LOAD before DROP), so no layer loses its last server. The
   layers a node keeps are its own replacement, back when its worker is
   ready; moves happen only while the model has a gap, when no route -- so
   no session -- can use any layer. One case has no safe order: a *swap*,
   where every covering layout needs two nodes to trade layers that each
   holds alone (a tight pool; rare, docs/measurements/2026-12-07.md). Rather
   than leave a pool that can cover with a gap, the
   tracker then makes one move at a time (``forced_move``: the fewest layers
   left without a server), onto layers the layout covers; the model is
   unusable until the gap closes anyway, so the swap costs only load time.
5. The shortfall. When no set of movers covers, the pool is short. It is
   told as the layers without a server, the smallest ``--memory`` of one more
   node with which the pool covers (bisected in whole MiB), and what that is
   beyond a node's fixed part (one forward's scratch): "need 410MiB more for
   layers 21:26: one more node with --memory 420MiB, or raise a node's
   budget". The size named is the one that needs no other node to move (the
   newcomer takes the gap), unless letting others move saves more than a
   tenth of it (every move is a reload).

The footprint of a range is ``ModelFootprint.range_bytes`` (its weights, the
embeddings at the head, the output at the tail, KV for the budget and a
forward's scratch); it only grows with the range, which makes "the longest
range that fits" a binary search and the share search monotone.

State: none. Members are frozen values; the caller (the tracker) keeps the
plan it is carrying out and the loads still pending.
"""
from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from meshd.plan.adverts import MAX_MEMORY_BYTES, MAX_PEER_ID_LEN, ShardAd, Span, live_adverts
from meshd.plan.assignment import ModelFootprint, RangeCosts
from meshd.plan.errors import PlanInputError
from meshd.sizes import format_size

# A mover's range may use share/SHARE_STEPS of its budget. 1/1024 is far finer
# than one layer of any real model, so the search finds the tightest share.
SHARE_STEPS = 1024
# Sets of movers tried before every movable node moves. Each costs about
# log2(SHARE_STEPS) sweeps of the movers; 512 sets cover every set of up to
# four movers among nine nodes.
MAX_MOVER_SETS = 512
# Up to this many movers every order is tried (5! = 120 sweeps); the head and
# the tail carry extra bytes, so who takes them can decide whether a tight
# pool covers. Beyond it: current order, then by budget, largest and smallest first.
MAX_PERMUTED = 5
# The shortfall names a node size in whole MiB: what a user types.
MIB = 1 << 20
# A newcomer that needs others to move costs them a reload each: the shortfall names the size of a
# node that closes the gap with everyone else where they are, unless moving them saves more than
# 1/MOVES_WORTH of it.
MOVES_WORTH = 10
# The stand-in for "one more node" in the shortfall search (never a peer id: has spaces).
NEWCOMER = "(one more node)"
# Pools whose shortfall is remembered (status pages ask every couple of seconds).
SHORTFALL_CACHE = 32


@dataclass(frozen=True, slots=True)
class Member:
    """One node of the pool as the layout sees it."""

    peer_id: str
    memory_bytes: int          # its declared budget (--memory); 0 when it advertises none
    span: Span | None = None   # the range it serves (or loads, see ``loading``); None: none yet
    movable: bool = True       # rule 1
    loading: bool = False      # its span is being loaded: covered soon, served by nobody yet

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not 0 < len(self.peer_id) <= MAX_PEER_ID_LEN:
            raise PlanInputError(f"peer_id must be a string of 1..{MAX_PEER_ID_LEN} characters")
        mem = self.memory_bytes
        if isinstance(mem, bool) or not isinstance(mem, int) or not 0 <= mem <= MAX_MEMORY_BYTES:
            raise PlanInputError(f"memory_bytes={mem!r} must be an int in [0, {MAX_MEMORY_BYTES}]")
        if self.span is not None and not isinstance(self.span, Span):
            raise PlanInputError("span must be a Span or None")
        if self.loading and (self.movable or self.span is None):
            raise PlanInputError("a loading member is pinned to the span it loads")


@dataclass(frozen=True, slots=True)
class Move:
    """One node's new range: DROP ``old`` (if any) and LOAD ``new``."""

    peer_id: str
    old: Span | None
    new: Span


@dataclass(frozen=True, slots=True)
class Layout:
    """The moves that make the pool cover every layer (by peer id), and the share of its budget
    each mover's new range may use (of SHARE_STEPS)."""

    moves: tuple[Move, ...]
    share: int
    safe: bool = True   # False: a swap, some move must give up a last copy (rule 4)

    @property
    def targets(self) -> dict[str, Span]:
        return {m.peer_id: m.new for m in self.moves}


@dataclass(frozen=True, slots=True)
class Shortfall:
    """How short the pool is: layers nobody serves and the memory that would close the gap."""

    gaps: tuple[Span, ...]
    need_bytes: int   # beyond a node's fixed part: what raising one node's budget has to add
    node_bytes: int   # the --memory of one more node with which the pool covers (whole MiB)

    @property
    def layers(self) -> str:
        return ", ".join(f"{g.start}:{g.end}" for g in self.gaps)

    def message(self) -> str:
        need = -(-self.need_bytes // MIB) * MIB
        return (f"need {format_size(need)} more for layers {self.layers}: one more node with "
                f"--memory {format_size(self.node_bytes)}, or raise a node's budget")

    def as_dict(self) -> dict:
        return {"gaps": [[g.start, g.end] for g in self.gaps], "need_bytes": self.need_bytes,
                "node_memory_bytes": self.node_bytes, "message": self.message()}


# ---------------------------------------------------------------------- members

def members_from_ads(ads: Iterable[ShardAd], *, model_digest: str, num_layers: int, now_ms: int,
                     tracker: str | None, pending: Mapping[str, Span] | None = None) -> tuple[Member, ...]:
    """The pool's members from its live ads (rule 1); ``pending``: peer -> span it was told to load
    and does not advertise yet (the tracker's own bookkeeping; others pass nothing)."""
    pending = pending or {}
    out: dict[str, Member] = {}
    for ad in live_adverts(ads, model_digest=model_digest, now_ms=now_ms):
        if ad.num_layers != num_layers:
            continue
        out[ad.peer_id] = Member(ad.peer_id, ad.memory_budget_bytes, ad.span,
                                 movable=ad.memory_budget_bytes > 0 and ad.peer_id != tracker)
    for peer, span in pending.items():
        if span.end > num_layers:
            raise PlanInputError(f"pending span {span} is outside a {num_layers}-layer model")
        known = out.get(peer)
        out[peer] = Member(peer, known.memory_bytes if known else 0, span, movable=False, loading=True)
    return tuple(out[p] for p in sorted(out))


def gaps_of(num_layers: int, members: Iterable[Member]) -> tuple[Span, ...]:
    """Runs of layers no member serves or loads."""
    covered = _covered(num_layers, (m.span for m in members if m.span is not None))
    out, start = [], None
    for layer, c in enumerate([*covered, True]):
        if not c and start is None:
            start = layer
        elif c and start is not None:
            out.append(Span(start, layer))
            start = None
    return tuple(out)


# ---------------------------------------------------------------------- sweeps

def _covered(n: int, spans: Iterable[Span]) -> list[bool]:
    covered = [False] * n
    for s in spans:
        if s.end > n:
            raise PlanInputError(f"span {s} is outside a {n}-layer model")
        covered[s.start:s.end] = [True] * s.length
    return covered


def _next_gap(covered: Sequence[bool], p: int) -> int:
    n = len(covered)
    while p < n and covered[p]:
        p += 1
    return p


class _Sweeper:
    """Longest ranges that fit a budget (prefix-sum costs of one footprint and KV budget)."""

    __slots__ = ("costs", "n")

    def __init__(self, footprint: ModelFootprint, kv_budget_tokens: int) -> None:
        self.costs = RangeCosts(footprint, kv_budget_tokens)
        self.n = footprint.num_layers

    def longest_end(self, start: int, budget: int) -> int:
        """The largest end with cost(start, end) <= budget, or ``start`` if not even one layer fits."""
        ends = range(start + 1, self.n + 1)
        return start + bisect.bisect_right(ends, budget, key=lambda e: self.costs.of(start, e))

    def sweep(self, covered: Sequence[bool], movers: Sequence[Member], share: int) -> dict[str, Span] | None:
        """Lay the movers left to right over the uncovered layers; None unless every layer is covered."""
        targets: dict[str, Span] = {}
        p = _next_gap(covered, 0)
        for m in movers:
            if p >= self.n:
                break
            end = self.longest_end(p, m.memory_bytes * share // SHARE_STEPS)
            if end > p:
                targets[m.peer_id] = Span(p, end)
                p = _next_gap(covered, end)
        return targets if p >= self.n else None

    def tightest(self, covered: Sequence[bool], movers: Sequence[Member]) -> tuple[int, dict[str, Span]] | None:
        """The smallest share (and its ranges) with which the movers cover (rule 3)."""
        if self.sweep(covered, movers, SHARE_STEPS) is None:
            return None
        lo, hi = 1, SHARE_STEPS   # hi covers; find the smallest share that does
        while lo < hi:
            mid = (lo + hi) // 2
            if self.sweep(covered, movers, mid) is None:
                lo = mid + 1
            else:
                hi = mid
        targets = self.sweep(covered, movers, hi)
        assert targets is not None  # monotone in the share: hi covered before
        return hi, targets


def _orders(movers: Sequence[Member], *, permute: bool) -> Iterable[tuple[Member, ...]]:
    """Current order (newcomers last, largest first), then by budget both ways -- or every order."""
    current = tuple(sorted(movers, key=lambda m: (0, m.span.start, m.span.end, 0, m.peer_id) if m.span
                           else (1, 0, 0, -m.memory_bytes, m.peer_id)))
    if permute and len(movers) <= MAX_PERMUTED:
        yield current
        yield from (order for order in itertools.permutations(current) if order != current)
        return
    yield current
    seen = {current}
    for key in (lambda m: (-m.memory_bytes, m.peer_id), lambda m: (m.memory_bytes, m.peer_id)):
        order = tuple(sorted(movers, key=key))
        if order not in seen:
            seen.add(order)
            yield order


# ---------------------------------------------------------------------- safe moves

def ready_moves(moves: Sequence[Move], served: Mapping[str, Span], num_layers: int) -> tuple[Move, ...]:
    """The moves that may start now (rule 4), as many as stay safe together.

    ``served``: peer -> the range it serves now (live ads; not what is still loading). A move is
    safe when every layer its node gives up is served by a node that is not moving in this batch.
    """
    count = [0] * num_layers
    for span in served.values():
        for layer in range(span.start, min(span.end, num_layers)):
            count[layer] += 1
    batch: list[Move] = []
    given_up: list[int] = []   # layers the batch's nodes give up: each needs a server outside the batch
    for move in sorted(moves, key=lambda m: m.peer_id):
        own = served.get(move.peer_id)
        own_layers = range(own.start, min(own.end, num_layers)) if own is not None else range(0)
        for layer in own_layers:
            count[layer] -= 1
        dropped = [x for x in own_layers if not move.new.start <= x < move.new.end]
        if all(count[x] > 0 for x in (*given_up, *dropped)):
            batch.append(move)
            given_up += dropped
        else:
            for layer in own_layers:
                count[layer] += 1
    return tuple(batch)


def forced_move(moves: Sequence[Move], served: Mapping[str, Span], num_layers: int) -> Move | None:
    """The move of a swap to make when none is safe (rule 4): the one that leaves the fewest layers
    without a server, then by peer id. Only for a model that has a gap already."""
    count = [0] * num_layers
    for span in served.values():
        for layer in range(span.start, min(span.end, num_layers)):
            count[layer] += 1

    def lost(move: Move) -> int:
        own = served.get(move.peer_id)
        if own is None:
            return 0
        return sum(1 for x in range(own.start, min(own.end, num_layers))
                   if count[x] == 1 and not move.new.start <= x < move.new.end)
    return min(moves, key=lambda m: (lost(m), m.peer_id), default=None)


def _sequenceable(moves: Sequence[Move], served: Mapping[str, Span], num_layers: int) -> bool:
    """Can every move be made, batch after batch, without a layer losing its last server?"""
    served = dict(served)
    todo = list(moves)
    while todo:
        batch = ready_moves(todo, served, num_layers)
        if not batch:
            return False
        for move in batch:
            served[move.peer_id] = move.new
        done = {m.peer_id for m in batch}
        todo = [m for m in todo if m.peer_id not in done]
    return True


# ---------------------------------------------------------------------- planning

class _Pool:
    """One planning problem: the members split into pinned and movable, coverage, what is served."""

    def __init__(self, footprint: ModelFootprint, members: Sequence[Member], kv_budget_tokens: int) -> None:
        n = footprint.num_layers
        peers = [m.peer_id for m in members]
        if len(set(peers)) != len(peers):
            raise PlanInputError("members must have distinct peer ids")
        for m in members:
            if m.span is not None and m.span.end > n:
                raise PlanInputError(f"{m.peer_id}'s span {m.span} is outside a {n}-layer model")
        self.n = n
        self.sweeper = _Sweeper(footprint, kv_budget_tokens)
        self.members = tuple(members)
        self.movable = tuple(m for m in members if m.movable)
        self.pinned = _covered(n, (m.span for m in members if not m.movable and m.span is not None))
        self.served = {m.peer_id: m.span for m in members if m.span is not None and not m.loading}
        self.spans = {m.peer_id: m.span for m in members}

    def covered_without(self, movers: Iterable[Member]) -> list[bool]:
        moving = {m.peer_id for m in movers}
        covered = list(self.pinned)
        for m in self.movable:
            if m.peer_id not in moving and m.span is not None:
                covered[m.span.start:m.span.end] = [True] * m.span.length
        return covered

    def attempt(self, movers: Sequence[Member], *, permute: bool, safe: bool) -> Layout | None:
        covered = self.covered_without(movers)
        for order in _orders(movers, permute=permute):
            found = self.sweeper.tightest(covered, order)
            if found is None:
                continue
            tight, targets = found
            for share in (tight, SHARE_STEPS) if tight < SHARE_STEPS else (tight,):
                if share != tight:   # the tightest ranges cannot be reached safely: try the longest
                    targets = self.sweeper.sweep(covered, order, share) or {}
                moves = tuple(Move(p, self.spans[p], span) for p, span in sorted(targets.items())
                              if self.spans[p] != span)
                if not safe or _sequenceable(moves, self.served, self.n):
                    return Layout(moves, share)
        return None

    def sole_layers(self, m: Member) -> int:
        """Layers of ``m``'s range no other member serves or loads (what moving it would uncover)."""
        if m.span is None:
            return 0
        others = _covered(self.n, (o.span for o in self.members if o.span is not None and o.peer_id != m.peer_id))
        return sum(1 for layer in range(m.span.start, m.span.end) if not others[layer])


def _search(pool: _Pool, *, safe: bool) -> Layout | None:
    """Rules 2 and 3: the first set of movers, smallest first, whose layout covers (and, when
    ``safe``, whose moves can be ordered by rule 4); every movable member as the last resort."""
    if all(pool.covered_without(())):
        return Layout((), SHARE_STEPS)
    if not _feasible(pool):
        return None
    new = tuple(m for m in pool.movable if m.span is None)   # nothing to reload: they always take part
    cands = sorted((m for m in pool.movable if m.span is not None), key=lambda m: (pool.sole_layers(m), m.peer_id))
    tried = 0
    for size in range(len(cands) + 1):
        for movers in itertools.combinations(cands, size):
            if tried >= MAX_MOVER_SETS:
                return pool.attempt(pool.movable, permute=True, safe=safe)
            tried += 1
            layout = pool.attempt((*new, *movers), permute=False, safe=safe)
            if layout is not None:
                return layout
    return pool.attempt(pool.movable, permute=True, safe=safe)


def plan_layout(footprint: ModelFootprint, members: Sequence[Member], kv_budget_tokens: int) -> Layout | None:
    """The fewest safe moves with which the pool covers every layer (a swap, ``safe=False``, when
    no safe order exists: rule 4); an empty layout when it already covers; None when it cannot
    (then ``pool_shortfall`` says by how much)."""
    pool = _Pool(footprint, members, kv_budget_tokens)
    layout = _search(pool, safe=True)
    if layout is not None:
        return layout
    swap = _search(pool, safe=False)
    return None if swap is None else Layout(swap.moves, swap.share, safe=False)


def _feasible(pool: _Pool) -> bool:
    """Whether every movable member, laid out again, covers: if no order of them does, no subset
    does either (a kept range is one such placement, at most as long as the sweep's), unless a
    range costs more than its node's budget -- which the planner never assigns."""
    return all(pool.covered_without(())) or pool.attempt(pool.movable, permute=True, safe=False) is not None


def coverable(footprint: ModelFootprint, members: Sequence[Member], kv_budget_tokens: int) -> bool:
    """Whether some layout covers every layer, however its moves would have to be ordered."""
    return _feasible(_Pool(footprint, members, kv_budget_tokens))


def node_fixed_bytes(footprint: ModelFootprint, kv_budget_tokens: int) -> int:
    """The part of a range's footprint that does not grow with its layers (one forward's scratch and
    whatever else a node pays once), read off the footprint itself: cost(a, a+1) + cost(a+1, a+2) -
    cost(a, a+2) away from the head and the tail."""
    n = footprint.num_layers
    if n < 2:
        return 0
    a = 1 if n >= 3 else 0
    cost = functools.partial(footprint.range_bytes, kv_budget_tokens=kv_budget_tokens)
    return max(0, cost(a, a + 1) + cost(a + 1, a + 2) - cost(a, a + 2))


def _smallest_node(footprint: ModelFootprint, members: tuple[Member, ...], kv_budget_tokens: int) -> int:
    """The smallest budget, in whole MiB, of one more node with which ``members`` cover the model."""
    def covers(mib: int) -> bool:
        return coverable(footprint, (*members, Member(NEWCOMER, mib * MIB)), kv_budget_tokens)

    n = footprint.num_layers
    lo, hi = 1, -(-footprint.range_bytes(0, n, kv_budget_tokens) // MIB)   # a node holding it all covers
    while lo < hi:
        mid = (lo + hi) // 2
        if covers(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi * MIB


@functools.lru_cache(maxsize=SHORTFALL_CACHE)
def pool_shortfall(footprint: ModelFootprint, members: tuple[Member, ...], kv_budget_tokens: int) -> Shortfall | None:
    """None when the pool can cover the model; else the layers without a server and the memory that
    would close the gap (rule 5). Pure and cached: the same pool gives the same answer everywhere."""
    if coverable(footprint, members, kv_budget_tokens):
        return None
    still = tuple(replace(m, movable=False) for m in members)
    node = _smallest_node(footprint, still, kv_budget_tokens)
    moving = _smallest_node(footprint, members, kv_budget_tokens)
    if moving * MOVES_WORTH < node * (MOVES_WORTH - 1):
        node = moving
    return Shortfall(gaps_of(footprint.num_layers, members),
                     max(0, node - node_fixed_bytes(footprint, kv_budget_tokens)), node)
