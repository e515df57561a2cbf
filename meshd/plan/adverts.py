"""Shard adverts and the coverage map: the planner's view of the swarm.

Data flow::

    DHT record (signed, verified by the daemon: proto/records.py + dht/)
        -> pb.CapabilityPayload
        -> ShardAd.from_payload(payload)        # validated here, remote fault if bad
        -> live_adverts(ads, model, now_ms)     # expiry + newest sequence per peer
        -> CoverageMap.build(ads, model, n)     # per layer: which peers serve it
        -> tracker.py / assignment.py / routing.py (all pure)

State: none. A ``ShardAd`` is an immutable, validated snapshot of one peer's
advertised layer range for one model artifact; a ``CoverageMap`` is an
immutable view computed from a set of ads. The daemon owns the record store
and decides which ads are "current"; nothing here reads a clock (``now_ms``
is always an argument) or touches the network.

A ``ShardAd`` that exists is a valid ad: layer bounds, throughput numbers and
identifiers are checked at construction. Building one from our own arguments
wrongly raises ``PlanInputError`` (a local bug); ``from_payload`` maps the
same failure to ``AdvertRejected`` (the advertising peer's fault).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from meshd.plan.errors import AdvertRejected, PlanInputError
from proto import shard_runtime_pb2 as pb

# Largest layer count a model may declare. The biggest public decoders have a
# few hundred layers; the bound keeps every per-layer table small.
MAX_LAYERS = 4096
# libp2p peer ids are ~52 base58 characters; leave room for other encodings.
MAX_PEER_ID_LEN = 128
# Artifact digests are hex SHA-256 (64 chars) with an optional "sha256:" tag.
MAX_DIGEST_LEN = 128
# A layer slower than a minute per token is useless for interactive decoding
# and would only distort the route costs.
MAX_DECODE_MS_PER_LAYER = 60_000.0
# Far above any CPU or GPU; bounds a peer's self-reported prefill speed.
MAX_PREFILL_TOKENS_PER_S = 1e9
# 1 PiB: above any home machine's memory, and well inside uint64/int64.
MAX_MEMORY_BYTES = 1 << 50
# KV positions a peer may claim to have free (a billion tokens is absurd
# already); keeps cost arithmetic in plain ints.
MAX_FREE_KV_TOKENS = 1 << 30
# Endpoint strings ("host:port") are short; a longer one is garbage.
MAX_ENDPOINT_LEN = 256
# pb.Backend values are small; an unknown larger one is kept as is (and matches nothing).
MAX_BACKEND_ENUM = 255


def _check_id(value: object, what: str, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise PlanInputError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > limit:
        raise PlanInputError(f"{what} is {len(value)} characters, limit {limit}")
    if not value.isprintable():
        raise PlanInputError(f"{what} contains non-printable characters")
    return value


def _check_int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanInputError(f"{what} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise PlanInputError(f"{what}={value} outside [{lo}, {hi}]")
    return value


def _check_float(value: object, what: str, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanInputError(f"{what} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or not 0.0 <= value <= hi:
        raise PlanInputError(f"{what}={value} outside [0, {hi}]")
    return float(value)


@dataclass(frozen=True, slots=True)
class Span:
    """Half-open layer interval ``[start, end)`` with ``start < end``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        _check_int(self.start, "span start", 0, MAX_LAYERS - 1)
        _check_int(self.end, "span end", 1, MAX_LAYERS)
        if self.start >= self.end:
            raise PlanInputError(f"empty span [{self.start}, {self.end})")

    @property
    def length(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.start}..{self.end - 1}" if self.length > 1 else str(self.start)


@dataclass(frozen=True, slots=True)
class ShardAd:
    """One peer's advertised range ``[start, end)`` of one model artifact."""

    peer_id: str
    model_digest: str
    start: int
    end: int
    num_layers: int
    decode_ms_per_layer: float
    prefill_tokens_per_s: float
    free_kv_tokens: int
    memory_budget_bytes: int
    relayed: bool
    expires_at_ms: int
    issued_at_ms: int = 0
    sequence: int = 0
    grpc_endpoint: str = ""
    # Runtime recipe (backend, dtype, ...) digest: a route must not mix recipes,
    # or the split model stops reproducing the whole model's tokens.
    recipe_digest: str = ""
    # Others can dial it directly: its signed record lists direct addresses (a node
    # behind NAT lists none, only relayed ones). Tracker duty needs it (tracker.py).
    dialable: bool = True
    # What the node measured of its memory (0: not published): the backend's working memory at
    # its validation forward, and its processes' base (daemon + worker before the weights).
    # footprint.measured_footprint sizes ranges of the same backend with them.
    backend: int = 0                    # pb.Backend of its worker
    measured_working_bytes: int = 0
    measured_base_bytes: int = 0
    # The layers whose weights it serves to fetching peers (held_end 0: only its range, if it
    # has a fetch port at all -- ``fetchable``). The tracker prefers ranges many peers hold.
    held_start: int = 0
    held_end: int = 0
    fetchable: bool = False

    def __post_init__(self) -> None:
        _check_id(self.peer_id, "peer_id", MAX_PEER_ID_LEN)
        _check_id(self.model_digest, "model_digest", MAX_DIGEST_LEN)
        _check_int(self.num_layers, "num_layers", 1, MAX_LAYERS)
        _check_int(self.start, "start", 0, self.num_layers - 1)
        _check_int(self.end, "end", self.start + 1, self.num_layers)
        _check_float(self.decode_ms_per_layer, "decode_ms_per_layer", MAX_DECODE_MS_PER_LAYER)
        _check_float(self.prefill_tokens_per_s, "prefill_tokens_per_s", MAX_PREFILL_TOKENS_PER_S)
        _check_int(self.free_kv_tokens, "free_kv_tokens", 0, MAX_FREE_KV_TOKENS)
        _check_int(self.memory_budget_bytes, "memory_budget_bytes", 0, MAX_MEMORY_BYTES)
        if not isinstance(self.relayed, bool):
            raise PlanInputError(f"relayed must be a bool, got {self.relayed!r}")
        if not isinstance(self.dialable, bool):
            raise PlanInputError(f"dialable must be a bool, got {self.dialable!r}")
        _check_int(self.issued_at_ms, "issued_at_ms", 0, 2**63 - 1)
        _check_int(self.expires_at_ms, "expires_at_ms", self.issued_at_ms + 1, 2**63 - 1)
        _check_int(self.sequence, "sequence", 0, 2**64 - 1)
        if not isinstance(self.grpc_endpoint, str) or len(self.grpc_endpoint) > MAX_ENDPOINT_LEN:
            raise PlanInputError("grpc_endpoint must be a string of at most "
                                 f"{MAX_ENDPOINT_LEN} characters")
        if self.recipe_digest:
            _check_id(self.recipe_digest, "recipe_digest", MAX_DIGEST_LEN)
        _check_int(self.backend, "backend", 0, MAX_BACKEND_ENUM)
        _check_int(self.measured_working_bytes, "measured_working_bytes", 0, MAX_MEMORY_BYTES)
        _check_int(self.measured_base_bytes, "measured_base_bytes", 0, MAX_MEMORY_BYTES)
        if self.held_end:
            _check_int(self.held_start, "held_start", 0, self.held_end - 1)
            _check_int(self.held_end, "held_end", 1, self.num_layers)
        if not isinstance(self.fetchable, bool):
            raise PlanInputError(f"fetchable must be a bool, got {self.fetchable!r}")

    @property
    def span(self) -> Span:
        return Span(self.start, self.end)

    @property
    def layers(self) -> int:
        return self.end - self.start

    @property
    def held(self) -> Span | None:
        """The layers peers can fetch from it (None: it has no fetch port)."""
        if not self.fetchable:
            return None
        return Span(self.held_start, self.held_end) if self.held_end else self.span

    def serves(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def is_live(self, now_ms: int) -> bool:
        """True while the ad has not expired at ``now_ms``."""
        return now_ms < self.expires_at_ms

    @classmethod
    def from_payload(cls, payload: pb.CapabilityPayload) -> ShardAd:
        """Validate a (signature-verified) capability payload into an ad.

        Raises ``AdvertRejected`` -- the advertising peer's fault -- for a
        wrong schema version, a withdrawal (not an ad: the caller should
        check ``payload.withdrawn`` first), or any field out of bounds.
        """
        if payload.schema_version != pb.SCHEMA_VERSION_1:
            raise AdvertRejected(f"capability schema_version {payload.schema_version} "
                                 "is not supported (want SCHEMA_VERSION_1)")
        if payload.withdrawn:
            raise AdvertRejected(f"peer {payload.peer_id!r} withdrew its advert; "
                                 "a withdrawal is not an ad")
        rng = payload.shard_range
        if rng.effective_start_layer not in (0, rng.start_layer):
            raise AdvertRejected("an advert's effective_start_layer must be 0 or its "
                                 f"start_layer, got {rng.effective_start_layer}")
        reach = payload.reachability
        relayed = not reach.direct_addrs and not reach.grpc_endpoint and bool(reach.relayed_addrs)
        memory = payload.memory
        base = memory.worker_base_bytes + memory.daemon_base_bytes
        try:
            return cls(
                peer_id=payload.peer_id,
                model_digest=payload.model_artifact_digest,
                start=rng.start_layer,
                end=rng.end_layer,
                num_layers=payload.num_layers,
                decode_ms_per_layer=payload.throughput.decode_ms_per_layer,
                prefill_tokens_per_s=payload.throughput.prefill_tokens_per_s,
                free_kv_tokens=payload.free_kv_tokens,
                memory_budget_bytes=payload.memory_budget_bytes,
                relayed=relayed,
                expires_at_ms=payload.expires_at_unix_ms,
                issued_at_ms=payload.issued_at_unix_ms,
                sequence=payload.sequence,
                grpc_endpoint=reach.grpc_endpoint,
                recipe_digest=payload.runtime_recipe_digest,
                dialable=bool(reach.direct_addrs),
                backend=payload.backend,
                measured_working_bytes=memory.working_bytes,
                measured_base_bytes=base,
                held_start=payload.held_start,
                held_end=payload.held_end,
                fetchable=bool(reach.fetch_endpoint),
            )
        except PlanInputError as exc:
            raise AdvertRejected(f"capability advert from {payload.peer_id!r}: {exc}") from exc


def live_adverts(ads: Iterable[ShardAd], *, model_digest: str, now_ms: int) -> tuple[ShardAd, ...]:
    """Ads of one model that are live at ``now_ms``, newest sequence per peer.

    A peer serves one range per model, so a newer ad replaces an older one
    (ties broken by the later expiry, then by the range, for determinism).
    The result is sorted by (peer_id, start, end): input order never matters.
    """
    best: dict[str, ShardAd] = {}
    for ad in ads:
        if ad.model_digest != model_digest or not ad.is_live(now_ms):
            continue
        cur = best.get(ad.peer_id)
        key = (ad.sequence, ad.expires_at_ms, ad.start, ad.end)
        if cur is None or key > (cur.sequence, cur.expires_at_ms, cur.start, cur.end):
            best[ad.peer_id] = ad
    return tuple(sorted(best.values(), key=lambda a: (a.peer_id, a.start, a.end)))


@dataclass(frozen=True, slots=True)
class CoverageMap:
    """Which peers serve each layer of one model (a pure view over ads).

    ``servers[l]`` is the sorted tuple of peer ids serving layer ``l``.
    Ads for other models, or disagreeing about the layer count, are left out
    (the layer count comes from the artifact, not from a peer's claim).
    """

    model_digest: str
    num_layers: int
    servers: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        _check_id(self.model_digest, "model_digest", MAX_DIGEST_LEN)
        _check_int(self.num_layers, "num_layers", 1, MAX_LAYERS)
        if len(self.servers) != self.num_layers:
            raise PlanInputError(f"coverage has {len(self.servers)} layers, "
                                 f"expected {self.num_layers}")

    @classmethod
    def build(cls, ads: Iterable[ShardAd], *, model_digest: str, num_layers: int) -> CoverageMap:
        _check_int(num_layers, "num_layers", 1, MAX_LAYERS)
        per_layer: list[set[str]] = [set() for _ in range(num_layers)]
        for ad in ads:
            if ad.model_digest != model_digest or ad.num_layers != num_layers:
                continue
            for layer in range(ad.start, ad.end):
                per_layer[layer].add(ad.peer_id)
        return cls(model_digest, num_layers, tuple(tuple(sorted(s)) for s in per_layer))

    def redundancy(self, layer: int) -> int:
        return len(self.servers[layer])

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(s) for s in self.servers)

    @property
    def fully_covered(self) -> bool:
        return all(self.servers)

    def runs(self) -> tuple[tuple[Span, int], ...]:
        """Maximal runs of equal redundancy, in layer order: ((span, count), ...)."""
        counts = self.counts
        out: list[tuple[Span, int]] = []
        start = 0
        for layer in range(1, self.num_layers + 1):
            if layer == self.num_layers or counts[layer] != counts[start]:
                out.append((Span(start, layer), counts[start]))
                start = layer
        return tuple(out)

    def gaps(self) -> tuple[Span, ...]:
        """Maximal runs of layers nobody serves, in layer order."""
        return tuple(span for span, count in self.runs() if count == 0)

    def weakest_span(self, within: Span | None = None) -> tuple[Span, int]:
        """The lowest-redundancy run: fewest servers, then longest, then first.

        While gaps exist this is the largest gap (count 0). ``within`` clips
        the runs to the layers a node holds (a GGUF slice).
        """
        runs = self.runs()
        if within is not None:
            if within.end > self.num_layers:
                raise PlanInputError(f"span {within} is outside a {self.num_layers}-layer model")
            runs = tuple((Span(max(s.start, within.start), min(s.end, within.end)), c) for s, c in runs
                         if s.start < within.end and within.start < s.end)
        return min(runs, key=lambda rc: (rc[1], -rc[0].length, rc[0].start))

    def without(self, peer_id: str) -> CoverageMap:
        """The map as it would be if ``peer_id`` stopped serving."""
        return CoverageMap(self.model_digest, self.num_layers,
                           tuple(tuple(p for p in s if p != peer_id) for s in self.servers))


def holder_counts(ads: Iterable[ShardAd], num_layers: int) -> tuple[int, ...]:
    """Per layer, how many peers serve its weights on a fetch port (``ShardAd.held``): where a
    node that must fetch its range gets its bytes fastest."""
    counts = [0] * num_layers
    for ad in ads:
        held = ad.held
        if held is None or ad.num_layers != num_layers:
            continue
        for layer in range(held.start, min(held.end, num_layers)):
            counts[layer] += 1
    return tuple(counts)
