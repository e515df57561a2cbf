"""Coverage-first shard assignment (the tracker's planning half; pure).

Data flow::

    CoverageMap (adverts.py) + ModelFootprint + JoinRequest(peer, memory, kv)
        -> plan_join()       -> Assignment(span, reason, needed bytes, intents)
    intents -> directives.build_directive() -> signed by the daemon -> DHT/peer

Closing a gap by moving nodes that already serve is layout.py's (the whole
pool at once); this module places one node.

Rules (ADR-0009 in the seeds: fill every gap before adding redundancy):

1. Target: while the model has gaps, the largest gap (longest, then first);
   only when fully covered, the weakest span (fewest servers, then longest,
   then first). ``CoverageMap.weakest_span`` encodes exactly this order.
2. Inside the target, the longest window whose footprint fits the node's
   declared memory (``--memory``: the whole node, daemon and worker): weights
   of the range (+ embeddings when it holds layer 0, + final norm/lm_head
   when it holds the last layer) + a KV budget of ``kv_budget_tokens``
   positions for every layer of the range + the backend's working memory
   (``ModelFootprint.working_bytes``, measured by workers and republished;
   without it, one batched forward's scratch, ``scratch_bytes``) + the
   node's process base (``base_bytes``: daemon + worker before the weights).
   Ties: the leftmost window, so a partly filled gap stays one contiguous gap.
3. If the window covers the whole target and memory is left, grow it one
   layer at a time towards the less redundant neighbour (right on a tie)
   while it fits: a node's memory is used, never idle.
4. A node that holds only some layers (a GGUF slice: ``JoinRequest.held``)
   is planned inside them: target, window and growth never leave ``held``.
   Where the bytes are only steers the choice among windows of the same
   length inside the target: the one that overlaps most what the node
   already holds without being bound to it (``JoinRequest.prefer``: a range
   it fetched before), then the one whose least-held layer has the most
   providers (``holders``: peers serving that layer's weights on a fetch
   port, ``adverts.holder_counts``), then the leftmost. Coverage still comes
   first: the target is the same with or without them.
5. A node that cannot hold one layer of the target gets ``NoFitError``
   (strictly coverage-first: it is not sent to add redundancy while a gap
   it cannot fill exists); the message says how much memory would do.

The footprint cost of a range only grows as the range grows, which is what
makes the window search a binary search. State: none; the caller passes the
coverage map of live ads (``plan_join`` removes the joiner's own ad).
"""
from __future__ import annotations

import bisect
import enum
import functools
from dataclasses import dataclass
from itertools import accumulate

from meshd.config import DEFAULT_KV_BUDGET_TOKENS
from meshd.plan.adverts import MAX_LAYERS, MAX_MEMORY_BYTES, CoverageMap, ShardAd, Span
from meshd.plan.errors import NoFitError, PlanInputError
from meshd.sizes import format_size
from proto import shard_runtime_pb2 as pb
from proto.limits import DEFAULT_PREFILL_CHUNK_TOKENS as SCRATCH_LOGIT_ROWS
from shard.session.batching import DEFAULT_BATCH_TOKENS as SCRATCH_POSITIONS

# Positions of KV cache a new range reserves per layer by default: the one
# setting the worker admits against too (meshd.config.DEFAULT_KV_BUDGET_TOKENS).
# Upper bound on a KV budget: 16M positions is beyond any model's context.
MAX_KV_BUDGET_TOKENS = 1 << 24
# Bytes of one layer's weights, bounded so sums stay exact and meaningful.
MAX_LAYER_BYTES = 1 << 40


class AssignmentReason(enum.Enum):
    FILL_GAP = "fill_gap"
    ADD_REDUNDANCY = "add_redundancy"
    UNCHANGED = "unchanged"  # the node already serves the range it would get


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """Memory a range of one model needs; per-layer weights may differ."""

    model_digest: str
    layer_weight_bytes: tuple[int, ...]
    head_extra_bytes: int = 0          # token embeddings, held with layer 0
    tail_extra_bytes: int = 0          # final norm + lm_head, held with the last layer
    kv_bytes_per_token_layer: int = 0  # K and V of one position in one layer
    # One batched forward's working memory (scratch), counted once per range: the
    # worker runs at most SCRATCH_POSITIONS positions per forward (shard/session/batching.py).
    scratch_row_bytes: int = 0         # activations of one position inside a layer
    score_bytes_per_kv_token: int = 0  # attention scores of one position per cached token
    logit_row_bytes: int = 0           # one position's logits, at the tail only
    # The backend's working memory per range, measured (meshd/plan/footprint.py); when set it
    # replaces the scratch estimate above. Counted once per range, like the scratch.
    working_bytes: int = 0
    # The node's fixed process memory (daemon + worker before any weight), once per range:
    # --memory is the whole node's promise, so the range gets what these leave.
    base_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layer_weight_bytes, tuple) or not 1 <= len(self.layer_weight_bytes) <= MAX_LAYERS:
            raise PlanInputError(f"layer_weight_bytes must be a tuple of 1..{MAX_LAYERS} ints")
        for name, value in (("head_extra_bytes", self.head_extra_bytes),
                            ("tail_extra_bytes", self.tail_extra_bytes),
                            ("kv_bytes_per_token_layer", self.kv_bytes_per_token_layer),
                            ("scratch_row_bytes", self.scratch_row_bytes),
                            ("score_bytes_per_kv_token", self.score_bytes_per_kv_token),
                            ("logit_row_bytes", self.logit_row_bytes),
                            ("working_bytes", self.working_bytes),
                            ("base_bytes", self.base_bytes),
                            *(("layer_weight_bytes", b) for b in self.layer_weight_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LAYER_BYTES:
                raise PlanInputError(f"{name}={value!r} must be an int in [0, {MAX_LAYER_BYTES}]")

    @classmethod
    def uniform(cls, model_digest: str, num_layers: int, layer_bytes: int, **extra: int) -> ModelFootprint:
        return cls(model_digest, (layer_bytes,) * num_layers, **extra)

    @property
    def num_layers(self) -> int:
        return len(self.layer_weight_bytes)

    def range_bytes(self, start: int, end: int, kv_budget_tokens: int) -> int:
        """Bytes to hold ``[start, end)`` with a KV budget (weights + extras + KV + working + base)."""
        return RangeCosts(self, kv_budget_tokens).of(start, end)

    def scratch_bytes(self, kv_budget_tokens: int, *, tail: bool) -> int:
        """One batched forward's working memory: ``working_bytes`` when measured, else the estimate:
        SCRATCH_POSITIONS positions through a layer (activations, attention scores over at most the
        KV budget), plus at the tail the logits of SCRATCH_LOGIT_ROWS positions (a prefill chunk on
        the torch lane's one-session path; one row per session of a batch, and a batch holds fewer
        sessions than that by default)."""
        if self.working_bytes:
            return self.working_bytes
        row = self.scratch_row_bytes + self.score_bytes_per_kv_token * kv_budget_tokens
        return SCRATCH_POSITIONS * row + (SCRATCH_LOGIT_ROWS * self.logit_row_bytes if tail else 0)


class RangeCosts:
    """Prefix sums for O(1) range footprints, built per plan (plan_join here, the layout search in layout.py)."""

    __slots__ = ("fp", "prefix", "kv_per_layer", "scratch", "tail_scratch")

    def __init__(self, fp: ModelFootprint, kv_budget_tokens: int) -> None:
        self.fp = fp
        self.prefix = (0, *accumulate(fp.layer_weight_bytes))
        self.kv_per_layer = kv_budget_tokens * fp.kv_bytes_per_token_layer
        self.scratch = fp.scratch_bytes(kv_budget_tokens, tail=False)
        self.tail_scratch = fp.scratch_bytes(kv_budget_tokens, tail=True)

    def of(self, start: int, end: int) -> int:
        n = self.fp.num_layers
        if not 0 <= start < end <= n:
            raise PlanInputError(f"range [{start}, {end}) outside a {n}-layer model")
        return (self.prefix[end] - self.prefix[start]
                + (self.fp.head_extra_bytes if start == 0 else 0)
                + (self.fp.tail_extra_bytes if end == n else 0)
                + self.kv_per_layer * (end - start)
                + (self.tail_scratch if end == n else self.scratch)
                + self.fp.base_bytes)

    def best_window(self, target: Span, memory: int, rank=None) -> Span | None:
        """Longest sub-span of ``target`` that fits ``memory``; among equally long ones the highest
        ``rank(span)`` (a tuple; None: all equal), then the leftmost."""
        best: Span | None = None
        best_key: tuple = ()
        for s in range(target.start, target.end):
            ends = range(s + 1, target.end + 1)
            fits = bisect.bisect_right(ends, memory, key=functools.partial(self.of, s))
            if not fits:
                continue
            window = Span(s, s + fits)
            key = (fits, *(rank(window) if rank is not None else ()))
            if best is None or key > best_key:
                best, best_key = window, key
        return best


def placement_rank(prefer: Span | None, holders: tuple[int, ...] | None):
    """The preference among equally long windows (rule 4): layers already held, then providers."""
    if prefer is None and holders is None:
        return None

    def rank(window: Span) -> tuple[int, int, int]:
        overlap = max(0, min(window.end, prefer.end) - max(window.start, prefer.start)) if prefer else 0
        counts = holders[window.start:window.end] if holders else (0,)
        return overlap, min(counts), sum(counts)
    return rank


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """A node asking for a range: ``meshd join --layers auto --memory 4GiB``."""

    peer_id: str
    memory_bytes: int
    kv_budget_tokens: int = DEFAULT_KV_BUDGET_TOKENS
    held: Span | None = None  # the layers the node has weights for (None: all of them)
    prefer: Span | None = None  # layers it holds but is not bound to (fetched before): preferred

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise PlanInputError("peer_id must be a non-empty string")
        for name in ("held", "prefer"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Span):
                raise PlanInputError(f"{name} must be a Span or None")
        for name, value, hi in (("memory_bytes", self.memory_bytes, MAX_MEMORY_BYTES),
                                ("kv_budget_tokens", self.kv_budget_tokens, MAX_KV_BUDGET_TOKENS)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
                raise PlanInputError(f"{name}={value!r} must be an int in [0, {hi}]")


@dataclass(frozen=True, slots=True)
class DirectiveIntent:
    """What the tracker wants one node to do; directives.py turns it into a payload."""

    action: pb.DirectiveAction  # LOAD_SHARD or DROP_SHARD
    target_peer_id: str
    span: Span

    def __post_init__(self) -> None:
        if self.action not in (pb.DIRECTIVE_ACTION_LOAD_SHARD, pb.DIRECTIVE_ACTION_DROP_SHARD):
            raise PlanInputError(f"directive action must be LOAD_SHARD or DROP_SHARD, got {self.action!r}")
        if not isinstance(self.target_peer_id, str) or not self.target_peer_id:
            raise PlanInputError("target_peer_id must be a non-empty string")
        if not isinstance(self.span, Span):
            raise PlanInputError("span must be a Span")


@dataclass(frozen=True, slots=True)
class Assignment:
    peer_id: str
    span: Span
    reason: AssignmentReason
    target: Span            # the gap / weakest span the choice started from
    needed_bytes: int       # footprint of ``span`` with the request's KV budget
    intents: tuple[DirectiveIntent, ...]


def _grow(costs: RangeCosts, window: Span, counts: tuple[int, ...], memory: int, bounds: Span) -> Span:
    """Extend a window layer by layer towards the less redundant side while it fits (inside ``bounds``)."""
    s, e = window.start, window.end
    while True:
        options = []
        if e < bounds.end:
            options.append((counts[e], 0, s, e + 1))      # right wins ties (0 < 1)
        if s > bounds.start:
            options.append((counts[s - 1], 1, s - 1, e))
        for _, _, ns, ne in sorted(options):
            if costs.of(ns, ne) <= memory:
                s, e = ns, ne
                break
        else:
            return Span(s, e)


def plan_join(coverage: CoverageMap, footprint: ModelFootprint, request: JoinRequest, *,
              current: Span | None = None, holders: tuple[int, ...] | None = None) -> Assignment:
    """Choose the range a joining (or re-planned) node should load.

    ``current`` is the range the node serves now, if any: its own servers
    entry is ignored, and the intents become DROP(current) + LOAD(new), or
    nothing if the answer is the range it already has. Whether moving a
    serving node is safe is the caller's call (layout.py orders moves safely).
    ``holders``: per layer, the peers that serve its weights (rule 4).
    """
    if coverage.num_layers != footprint.num_layers or coverage.model_digest != footprint.model_digest:
        raise PlanInputError(f"coverage ({coverage.model_digest}, {coverage.num_layers} layers) and "
                             f"footprint ({footprint.model_digest}, {footprint.num_layers}) disagree")
    view = coverage.without(request.peer_id)
    counts = view.counts
    costs = RangeCosts(footprint, request.kv_budget_tokens)
    bounds = request.held or Span(0, footprint.num_layers)
    if bounds.end > footprint.num_layers:
        raise PlanInputError(f"held span {bounds} is outside a {footprint.num_layers}-layer model")
    target, redundancy = view.weakest_span(within=request.held)
    if holders is not None and len(holders) != footprint.num_layers:
        raise PlanInputError(f"holders has {len(holders)} entries for a {footprint.num_layers}-layer model")
    window = costs.best_window(target, request.memory_bytes, placement_rank(request.prefer, holders))
    if window is None:
        cheapest = min(costs.of(layer, layer + 1) for layer in range(target.start, target.end))
        kind = "the coverage gap" if redundancy == 0 else "the weakest span"
        raise NoFitError(
            f"{format_size(request.memory_bytes)} cannot hold one layer of {kind} {target} "
            f"(needs at least {format_size(cheapest)} with a KV budget of "
            f"{request.kv_budget_tokens} tokens); declare more memory with --memory, lower "
            "--kv-budget-tokens, or let a larger node take this span")
    if window == target:
        window = _grow(costs, window, counts, request.memory_bytes, bounds)
    reason = AssignmentReason.FILL_GAP if redundancy == 0 else AssignmentReason.ADD_REDUNDANCY
    intents: tuple[DirectiveIntent, ...]
    if current == window:
        reason, intents = AssignmentReason.UNCHANGED, ()
    else:
        load = DirectiveIntent(pb.DIRECTIVE_ACTION_LOAD_SHARD, request.peer_id, window)
        intents = (load,) if current is None else (
            DirectiveIntent(pb.DIRECTIVE_ACTION_DROP_SHARD, request.peer_id, current), load)
    return Assignment(request.peer_id, window, reason, target,
                      costs.of(window.start, window.end), intents)


def simulate_joins(footprint, nodes: int, memory: int, kv_tokens: int):
    """The ranges ``nodes`` equal joiners get, one after the other (the tracker's pure planner)."""
    ads: list[ShardAd] = []
    for i in range(nodes):
        coverage = CoverageMap.build(ads, model_digest=footprint.model_digest, num_layers=footprint.num_layers)
        span = plan_join(coverage, footprint, JoinRequest(f"node{i}", memory, kv_tokens)).span
        ads.append(ShardAd(peer_id=f"node{i}", model_digest=footprint.model_digest, start=span.start, end=span.end,
                           num_layers=footprint.num_layers, decode_ms_per_layer=1.0, prefill_tokens_per_s=1.0,
                           free_kv_tokens=kv_tokens, memory_budget_bytes=memory, relayed=False,
                           expires_at_ms=2**62))
    return CoverageMap.build(ads, model_digest=footprint.model_digest, num_layers=footprint.num_layers)


# What ``even_memory_for`` adds to a node's estimated process base: the lane's estimate of the daemon
# and worker bases can be below what nodes then measure and publish (a torch daemon imports the
# tokenizer's libraries), and a swarm plans with the measured figures once they arrive -- a demo sized
# on the estimates alone could leave a layer unserved.
EVEN_BASE_HEADROOM_BYTES = 128 << 20


def even_memory_for(footprint, nodes: int, kv_tokens: int) -> int:
    """The smallest memory (in half-layer steps) with which ``nodes`` joiners cover the model, the
    processes' base taken EVEN_BASE_HEADROOM_BYTES above the estimate."""
    from dataclasses import replace

    footprint = replace(footprint, base_bytes=footprint.base_bytes + EVEN_BASE_HEADROOM_BYTES)
    n = footprint.num_layers
    layer = (footprint.range_bytes(0, 2, kv_tokens) - footprint.range_bytes(0, 1, kv_tokens) if n > 2
             else footprint.range_bytes(0, 1, kv_tokens) - footprint.head_extra_bytes)   # weights + KV, no scratch
    step = max(1, layer // 2)
    memory = footprint.range_bytes(0, 1, kv_tokens)
    for _ in range(4 * footprint.num_layers):
        try:
            if simulate_joins(footprint, nodes, memory, kv_tokens).fully_covered:
                return memory
        except NoFitError:
            pass
        memory += step
    return footprint.range_bytes(0, footprint.num_layers, kv_tokens)
