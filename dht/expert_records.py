"""Signed expert placement records: which experts a peer serves without their layers (sans-I/O).

An expert record is a ``pb.SignedRecord`` (kind EXPERTS) whose payload is a
``pb.ExpertPlacementPayload``: the peer, the model (artifact + recipe
digests), the experts as runs of (layers x experts, plus shared experts),
the TLS endpoint of its expert exchange with the certificate pin, the
protocol versions and activation formats it speaks, a measured cost, and
issue time, expiry and sequence. ``meshd join --experts`` signs one after
its worker's validation forward passed (meshd/daemon/experts_part.py); every
expert peer's record of a model lives in ONE index key,
``/meshd/experts/<artifact digest>`` (dht/keys.py), as a record set encoded
and merged exactly like a capability index (one record per peer, highest
sequence wins, expired ones dropped, a withdrawal hides the peer).

Rules (checked in this order by ``validate_experts``), as for capabilities:

1. size: at most ``MAX_RECORD_BYTES`` serialized, before parsing;
2. the wrapper parses and its kind is EXPERTS;
3. the Ed25519 signature over the domain-separated payload verifies;
4. the payload parses and its schema version is one we know;
5. the public key hashes to the peer id named inside the payload;
6. bounds: digests well-formed; 1..``MAX_EXPERT_RUNS`` runs (none for a
   withdrawal), each with first <= last, layers < num_layers <= MAX_LAYERS,
   experts < num_experts <= ``MAX_EXPERTS_PER_LAYER``, something in it
   (routed or shared); an endpoint ``host:port`` of at most
   MAX_ENDPOINT_CHARS with a 32-byte certificate pin; at most
   ``MAX_PROTOCOL_ENTRIES`` versions and acts;
7. not future-dated beyond ``MAX_CLOCK_SKEW_MS``, lifetime at most
   ``MAX_RECORD_LIFETIME_MS``, not expired.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dht.errors import RecordRejected
from dht.records import (
    DIGEST_RE,
    MAX_ENDPOINT_CHARS,
    MAX_LAYERS,
    check_lifetime,
    decode_record_set,
    open_signed,
    sign_payload,
)
from proto import shard_runtime_pb2 as pb

__all__ = ["ExpertClaim", "ExpertRecord", "sign_experts", "sign_experts_withdrawal", "validate_experts",
           "validate_expert_set", "parse_expert_set_lenient", "MAX_EXPERT_RUNS", "MAX_EXPERTS_PER_LAYER"]

# Runs of (layers x experts): a peer serves a few blocks of experts; 128 runs
# of at most ~26 bytes keep a record under MAX_RECORD_BYTES (4 KiB).
MAX_EXPERT_RUNS = 128
# Routed experts per MoE layer (the exchange's own bound, proto/moe_wire.py).
MAX_EXPERTS_PER_LAYER = 512
MAX_PROTOCOL_ENTRIES = 8
_ENDPOINT_RE = re.compile(r"^\[?[A-Za-z0-9.:-]{1,253}\]?:(\d{1,5})$")


@dataclass(frozen=True, slots=True)
class ExpertClaim:
    """What an expert peer claims; signed into a record by ``sign_experts``."""

    model_artifact_digest: str
    runtime_recipe_digest: str
    runs: tuple[pb.ExpertRun, ...]
    num_layers: int
    num_experts: int
    endpoint: str
    tls_cert_sha256: bytes
    protocol_versions: tuple[int, ...] = (1, 2)
    acts: tuple[int, ...] = (1, 2)
    ms_per_expert_row: float = 0.0
    weight_bytes: int = 0

    def __post_init__(self) -> None:
        problem = _bounds_problem(self._payload(peer_id="x", now_ms=0, ttl_ms=1, sequence=0), withdrawn=False)
        if problem:
            raise ValueError(problem)

    def _payload(self, *, peer_id: str, now_ms: int, ttl_ms: int, sequence: int) -> pb.ExpertPlacementPayload:
        return pb.ExpertPlacementPayload(
            schema_version=pb.SCHEMA_VERSION_1, peer_id=peer_id, model_artifact_digest=self.model_artifact_digest,
            runtime_recipe_digest=self.runtime_recipe_digest, runs=list(self.runs), num_layers=self.num_layers,
            num_experts=self.num_experts, endpoint=self.endpoint, tls_cert_sha256=self.tls_cert_sha256,
            protocol_versions=list(self.protocol_versions), acts=list(self.acts),
            ms_per_expert_row=self.ms_per_expert_row, weight_bytes=self.weight_bytes,
            issued_at_unix_ms=now_ms, expires_at_unix_ms=now_ms + ttl_ms, sequence=sequence)


@dataclass(frozen=True, slots=True)
class ExpertRecord:
    """A record that passed ``validate_experts``: exists only when valid."""

    raw: bytes = field(repr=False)
    peer_id: str
    sequence: int
    model_artifact_digest: str
    issued_at_ms: int
    expires_at_ms: int
    withdrawn: bool
    payload: pb.ExpertPlacementPayload = field(repr=False, compare=False, hash=False)

    def expired(self, now_ms: int) -> bool:
        return self.expires_at_ms <= now_ms

    def pairs(self, shared_id: int) -> frozenset[tuple[int, int]]:
        """Every (layer, expert) the record names; a layer's shared expert as ``shared_id``."""
        out: set[tuple[int, int]] = set()
        for run in self.payload.runs:
            for layer in range(run.first_layer, run.last_layer + 1):
                if run.routed:
                    out.update((layer, e) for e in range(run.first_expert, run.last_expert + 1))
                if run.shared:
                    out.add((layer, shared_id))
        return frozenset(out)


def _bounds_problem(p: pb.ExpertPlacementPayload, *, withdrawn: bool) -> str | None:
    if not DIGEST_RE.match(p.model_artifact_digest):
        return "model_artifact_digest has a bad form"
    if p.runtime_recipe_digest and not DIGEST_RE.match(p.runtime_recipe_digest):
        return "runtime_recipe_digest has a bad form"
    if withdrawn:
        return "a withdrawal carries no runs" if p.runs else None
    if not 0 < p.num_layers <= MAX_LAYERS or not 0 < p.num_experts <= MAX_EXPERTS_PER_LAYER:
        return f"num_layers {p.num_layers} / num_experts {p.num_experts} out of bounds"
    if not 1 <= len(p.runs) <= MAX_EXPERT_RUNS:
        return f"an expert record carries 1..{MAX_EXPERT_RUNS} runs, not {len(p.runs)}"
    for run in p.runs:
        if not run.first_layer <= run.last_layer < p.num_layers:
            return f"layer run {run.first_layer}..{run.last_layer} of {p.num_layers} layers"
        if run.routed and not run.first_expert <= run.last_expert < p.num_experts:
            return f"expert run {run.first_expert}..{run.last_expert} of {p.num_experts} experts"
        if not (run.routed or run.shared):
            return "an empty run"
    match = _ENDPOINT_RE.match(p.endpoint)
    if len(p.endpoint) > MAX_ENDPOINT_CHARS or match is None or not 0 < int(match.group(1)) < 65536:
        return "endpoint must be host:port"
    if len(p.tls_cert_sha256) != 32:
        return "an expert endpoint needs its 32-byte certificate hash (tls_cert_sha256)"
    if len(p.protocol_versions) > MAX_PROTOCOL_ENTRIES or len(p.acts) > MAX_PROTOCOL_ENTRIES:
        return "too many protocol versions or acts"
    if not p.protocol_versions or not p.acts:
        return "an expert record names the versions and acts it speaks"
    if not math.isfinite(p.ms_per_expert_row) or p.ms_per_expert_row < 0:
        return "ms_per_expert_row must be a finite non-negative number"
    return None


def sign_experts(claim: ExpertClaim, key, *, peer_id: str, sequence: int, now_ms: int, ttl_ms: int) -> bytes:
    """Sign ``claim`` with ``key`` (cryptography Ed25519PrivateKey); returns record bytes."""
    payload = claim._payload(peer_id=peer_id, now_ms=now_ms, ttl_ms=ttl_ms, sequence=sequence)
    return sign_payload(pb.RECORD_KIND_EXPERTS, payload, key)


def sign_experts_withdrawal(model_artifact_digest: str, key, *, peer_id: str, sequence: int, now_ms: int,
                            ttl_ms: int) -> bytes:
    """A tombstone: no runs, ``withdrawn`` set; it outranks the live record by sequence."""
    if not DIGEST_RE.match(model_artifact_digest):
        raise ValueError("model_artifact_digest has a bad form")
    payload = pb.ExpertPlacementPayload(schema_version=pb.SCHEMA_VERSION_1, peer_id=peer_id,
                                        model_artifact_digest=model_artifact_digest, issued_at_unix_ms=now_ms,
                                        expires_at_unix_ms=now_ms + ttl_ms, sequence=sequence, withdrawn=True)
    return sign_payload(pb.RECORD_KIND_EXPERTS, payload, key)


def validate_experts(data: bytes, now_ms: int) -> ExpertRecord:
    """Check every rule in the module docstring; raise RecordRejected(reason) on the first broken."""
    payload = open_signed(data, pb.RECORD_KIND_EXPERTS, pb.ExpertPlacementPayload)
    problem = _bounds_problem(payload, withdrawn=payload.withdrawn)
    if problem:
        raise RecordRejected("malformed", problem)
    issued, expires = check_lifetime(payload, now_ms)
    return ExpertRecord(raw=data, peer_id=payload.peer_id, sequence=payload.sequence,
                        model_artifact_digest=payload.model_artifact_digest, issued_at_ms=issued,
                        expires_at_ms=expires, withdrawn=payload.withdrawn, payload=payload)


def validate_expert_set(data: bytes, now_ms: int) -> list[ExpertRecord]:
    """Strict: every record valid and at most one per peer, else RecordRejected."""
    records = [validate_experts(raw, now_ms) for raw in decode_record_set(data)]
    peers = [r.peer_id for r in records]
    if len(set(peers)) != len(peers):
        raise RecordRejected("malformed", "two records of one peer in a set")
    if not records:
        raise RecordRejected("malformed", "an empty record set")
    return records


def parse_expert_set_lenient(data: bytes, now_ms: int) -> list[ExpertRecord]:
    """For stored sets: drop records that expired since; anything else broken refuses the set."""
    out = []
    for raw in decode_record_set(data):
        try:
            out.append(validate_experts(raw, now_ms))
        except RecordRejected as exc:
            if exc.reason != "expired":
                raise
    return out


def live_experts(records: Sequence[ExpertRecord], now_ms: int) -> list[ExpertRecord]:
    return [r for r in records if not r.withdrawn and not r.expired(now_ms)]
