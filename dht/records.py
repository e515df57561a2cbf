"""Signed capability records: build, validate, order and merge (sans-I/O).

A capability record is a ``pb.SignedRecord`` (kind CAPABILITY) whose payload
is a ``pb.CapabilityPayload``. This module is pure: no sockets, no libp2p
runtime, no global clock -- every function that needs the time takes
``now_ms`` (wall-clock milliseconds) from the caller.

Rules (checked in this order by ``validate_capability``):

1. size: at most ``MAX_RECORD_BYTES`` serialized, before parsing;
2. the wrapper parses and its kind is CAPABILITY;
3. the Ed25519 signature over the domain-separated payload verifies
   (``proto.records.verify_record_signature``);
4. the payload parses and its schema version is one we know;
5. the public key hashes to the peer id named inside the payload;
6. every field is within its bound (digest charset, range, address counts);
7. it is not dated in the future beyond ``MAX_CLOCK_SKEW_MS``, its lifetime
   is at most ``MAX_RECORD_LIFETIME_MS``, and it has not expired.

Ordering: per peer, a record with a higher ``sequence`` replaces a lower one;
an equal or lower sequence (a replay) never replaces (``check_replaces``).
A withdrawal is a record with ``withdrawn`` set and an empty range: it wins
by sequence like any other record and hides the peer until it expires.

Checked once: ``RecordCache`` remembers records that passed rules 1-6 by their
exact bytes (rules 1-6 depend on nothing else), so a node that sees the same
signed record again -- in every index value it stores, serves, merges or
reads, many times a minute -- re-checks only rule 7, the clock. Callers
pass their own cache (``cache=``); without one every rule runs every time.

A ``RecordSet`` (the value of an index key, see dht/keys.py) holds at most one
record per peer, at most ``MAX_INDEX_RECORDS`` records, and is encoded as
``MAGIC || u16 count || (u32 length || SignedRecord bytes)*`` (big-endian).
"""
from __future__ import annotations

import re
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from google.protobuf.message import DecodeError

from dht.errors import RecordRejected
from dht.identity import peer_id_from_public_key
from proto import shard_runtime_pb2 as pb
from proto.errors import PayloadCorrupt
from proto.records import sign_record, verify_record_signature

SUPPORTED_SCHEMA_VERSIONS = frozenset({pb.SCHEMA_VERSION_1})
# A capability payload with a handful of addresses is ~500 bytes; 4 KiB leaves
# room for relayed addresses while keeping an index of 128 records < 1 MiB,
# py-libp2p's MAX_RECORD_SIZE for one DHT value.
MAX_RECORD_BYTES = 4096
# One record per peer per index key; 128 peers serving one model (or one span)
# is far beyond a home swarm, and 128 x 4 KiB stays under the DHT value limit.
MAX_INDEX_RECORDS = 128
# Clocks of home machines drift; 30 s tolerates NTP-less boxes but not a
# record minted for tomorrow.
MAX_CLOCK_SKEW_MS = 30_000
# No record may claim to live longer than an hour (config MAX_RECORD_TTL_S).
MAX_RECORD_LIFETIME_MS = 3_600_000
MAX_DIRECT_ADDRS = 16
MAX_RELAYED_ADDRS = 16
MAX_ADDR_CHARS = 512
MAX_ENDPOINT_CHARS = 256
MAX_MODEL_ID_CHARS = 256
# Digest strings name keys: "sha256:<64 hex>" fits; keys must stay < 128 bytes.
MAX_DIGEST_CHARS = 80
MAX_LAYERS = 100_000
MAX_DTYPES = 8
# MoE holders name the experts they need as runs (dht/expert_records.py has the same bound).
MAX_DELEGATED_RUNS = 128
MAX_EXPERT_ID = 511
DIGEST_RE = re.compile(rf"^[A-Za-z0-9:._-]{{1,{MAX_DIGEST_CHARS}}}$")
SET_MAGIC = b"MSR1"
# Records one RecordCache remembers: a home swarm has a few records per peer;
# 2048 x (<= 4 KiB raw + its parsed payload) bounds the memory a flood of
# minted records can make a node spend on remembering them.
RECORD_CACHE_ENTRIES = 2048
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class CapabilityClaim:
    """What a node claims about its worker; signed into a record by ``sign_capability``."""

    model_artifact_digest: str
    runtime_recipe_digest: str
    start_layer: int
    end_layer: int
    num_layers: int
    backend: pb.Backend = pb.BACKEND_TORCH
    dtypes: tuple[pb.DType, ...] = (pb.DTYPE_FLOAT32,)
    model_id: str = ""
    direct_addrs: tuple[str, ...] = ()
    relayed_addrs: tuple[str, ...] = ()
    grpc_endpoint: str = ""
    tls_cert_sha256: bytes = b""
    frames_endpoint: str = ""      # the framed fast path (same certificate as grpc_endpoint)
    memory_budget_bytes: int = 0
    free_kv_tokens: int = 0
    decode_ms_per_layer: float = 0.0
    prefill_tokens_per_s: float = 0.0
    # MoE: experts of the range that expert peers must serve (pb.ExpertRun, as the worker reported them).
    delegated_experts: tuple = ()
    # The node's measured memory (pb.MemoryFigures: the worker's figures + the daemon's base); None: unmeasured.
    memory: pb.MemoryFigures | None = None
    # The fetch port (same certificate) and the layers whose weights it serves (held_end 0: none).
    fetch_endpoint: str = ""
    held_start: int = 0
    held_end: int = 0
    artifact_sha256: str = ""      # the model file's SHA-256, beside the root (model_artifact_digest)

    def __post_init__(self) -> None:
        _check_digest(self.model_artifact_digest, "model_artifact_digest")
        problem = _runs_problem(self.delegated_experts, self.num_layers)
        if problem:
            raise ValueError(problem)
        if self.runtime_recipe_digest:
            _check_digest(self.runtime_recipe_digest, "runtime_recipe_digest")
        if not 0 <= self.start_layer < self.end_layer <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"bad layer range {self.start_layer}:{self.end_layer} of {self.num_layers}")
        if self.tls_cert_sha256 and len(self.tls_cert_sha256) != 32:
            raise ValueError("tls_cert_sha256 must be 32 bytes")
        if self.frames_endpoint and not self.grpc_endpoint:
            raise ValueError("a frames_endpoint needs the grpc_endpoint it is a fast path beside")
        if self.fetch_endpoint and len(self.tls_cert_sha256) != 32:
            raise ValueError("a fetch_endpoint needs the certificate pin (tls_cert_sha256)")
        if self.held_end and not 0 <= self.held_start < self.held_end <= self.num_layers:
            raise ValueError(f"bad held range {self.held_start}:{self.held_end} of {self.num_layers}")
        if self.artifact_sha256:
            _check_digest(self.artifact_sha256, "artifact_sha256")


@dataclass(frozen=True, slots=True)
class CapabilityRecord:
    """A record that passed ``validate_capability``: exists only when valid."""

    raw: bytes = field(repr=False)
    peer_id: str
    sequence: int
    model_artifact_digest: str
    start_layer: int
    end_layer: int
    num_layers: int
    issued_at_ms: int
    expires_at_ms: int
    withdrawn: bool
    payload: pb.CapabilityPayload = field(repr=False, compare=False, hash=False)

    @property
    def span(self) -> tuple[int, int]:
        return (self.start_layer, self.end_layer)

    def expired(self, now_ms: int) -> bool:
        return self.expires_at_ms <= now_ms


def _check_digest(value: str, name: str) -> None:
    if not DIGEST_RE.match(value):
        raise ValueError(f"{name} must match {DIGEST_RE.pattern}")


def sign_capability(claim: CapabilityClaim, key, *, peer_id: str, sequence: int,
                    now_ms: int, ttl_ms: int) -> bytes:
    """Sign ``claim`` with ``key`` (cryptography Ed25519PrivateKey); returns record bytes."""
    payload = pb.CapabilityPayload(
        schema_version=pb.SCHEMA_VERSION_1, peer_id=peer_id,
        model_artifact_digest=claim.model_artifact_digest,
        runtime_recipe_digest=claim.runtime_recipe_digest,
        shard_range=pb.ShardRange(start_layer=claim.start_layer, end_layer=claim.end_layer,
                                  effective_start_layer=claim.start_layer),
        backend=claim.backend, dtypes=list(claim.dtypes),
        memory_budget_bytes=claim.memory_budget_bytes, free_kv_tokens=claim.free_kv_tokens,
        throughput=pb.Throughput(decode_ms_per_layer=claim.decode_ms_per_layer,
                                 prefill_tokens_per_s=claim.prefill_tokens_per_s),
        reachability=pb.Reachability(direct_addrs=list(claim.direct_addrs),
                                     relayed_addrs=list(claim.relayed_addrs),
                                     grpc_endpoint=claim.grpc_endpoint,
                                     tls_cert_sha256=claim.tls_cert_sha256,
                                     frames_endpoint=claim.frames_endpoint,
                                     fetch_endpoint=claim.fetch_endpoint),
        issued_at_unix_ms=now_ms, expires_at_unix_ms=now_ms + ttl_ms, sequence=sequence,
        model_id=claim.model_id, num_layers=claim.num_layers, delegated_experts=list(claim.delegated_experts),
        memory=claim.memory,
        held_start=claim.held_start, held_end=claim.held_end, artifact_sha256=claim.artifact_sha256)
    return _sign(payload, key)


def sign_withdrawal(model_artifact_digest: str, key, *, peer_id: str, sequence: int,
                    now_ms: int, ttl_ms: int) -> bytes:
    """A tombstone: empty range, ``withdrawn`` set; it outranks the live record by sequence."""
    _check_digest(model_artifact_digest, "model_artifact_digest")
    payload = pb.CapabilityPayload(
        schema_version=pb.SCHEMA_VERSION_1, peer_id=peer_id,
        model_artifact_digest=model_artifact_digest, shard_range=pb.ShardRange(),
        issued_at_unix_ms=now_ms, expires_at_unix_ms=now_ms + ttl_ms, sequence=sequence,
        withdrawn=True)
    return _sign(payload, key)


def _sign(payload: pb.CapabilityPayload, key) -> bytes:
    return sign_payload(pb.RECORD_KIND_CAPABILITY, payload, key)


def sign_payload(kind: pb.RecordKind, payload, key) -> bytes:
    """A serialized SignedRecord of ``kind`` over ``payload``; ValueError when over MAX_RECORD_BYTES."""
    data = sign_record(kind, payload.SerializeToString(), key).SerializeToString()
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"record is {len(data)} bytes, over MAX_RECORD_BYTES={MAX_RECORD_BYTES}")
    return data


def open_signed(data: bytes, kind: int, payload_cls):
    """The rules every signed DHT record shares, in order: size, SignedRecord, ``kind``,
    signature, payload of ``payload_cls``, schema version, key matches the payload's peer id."""
    if len(data) > MAX_RECORD_BYTES:
        raise RecordRejected("too_large", f"{len(data)} bytes > {MAX_RECORD_BYTES}")
    try:
        signed = pb.SignedRecord.FromString(data)
    except DecodeError as exc:
        raise RecordRejected("malformed", "not a SignedRecord") from exc
    if signed.kind != kind:
        raise RecordRejected("kind", f"record kind {signed.kind} is not {pb.RecordKind.Name(kind)[12:]}")
    try:
        verify_record_signature(signed)
    except PayloadCorrupt as exc:
        raise RecordRejected("signature", str(exc)) from exc
    try:
        payload = payload_cls.FromString(signed.payload)
    except DecodeError as exc:
        raise RecordRejected("malformed", f"payload is not a {payload_cls.__name__}") from exc
    if payload.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        raise RecordRejected("schema", f"unknown schema version {payload.schema_version}")
    if peer_id_from_public_key(signed.public_key) != payload.peer_id:
        raise RecordRejected("peer_id", "the signing key does not match the peer id in the record")
    return payload


def check_lifetime(payload, now_ms: int) -> tuple[int, int]:
    """(issued, expires) once the record is not future-dated, not over-long and not expired."""
    issued, expires = payload.issued_at_unix_ms, payload.expires_at_unix_ms
    if issued > now_ms + MAX_CLOCK_SKEW_MS:
        raise RecordRejected("future", f"issued {issued - now_ms} ms in the future")
    if not issued < expires <= issued + MAX_RECORD_LIFETIME_MS:
        raise RecordRejected("malformed", "lifetime must be within (0, MAX_RECORD_LIFETIME_MS]")
    if expires <= now_ms:
        raise RecordRejected("expired", f"expired {now_ms - expires} ms ago")
    return issued, expires


class RecordCache:
    """Capability records that passed rules 1-6, by their exact bytes (LRU, at most ``capacity``).

    Only the clock (rule 7) depends on anything but the bytes, so a hit needs
    only ``check_lifetime`` again; a rejected record is never remembered.
    State: an OrderedDict raw -> CapabilityRecord, oldest first; ``hits`` and
    ``misses`` count lookups (for tests and measurements). Not thread-safe: one
    trio loop owns it (each DhtNode has its own)."""

    def __init__(self, capacity: int = RECORD_CACHE_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._records: OrderedDict[bytes, CapabilityRecord] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._records)

    def get(self, data: bytes) -> CapabilityRecord | None:
        rec = self._records.get(data)
        if rec is None:
            self.misses += 1
            return None
        self._records.move_to_end(data)
        self.hits += 1
        return rec

    def put(self, rec: CapabilityRecord) -> None:
        self._records[rec.raw] = rec
        self._records.move_to_end(rec.raw)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)


def validate_capability(data: bytes, now_ms: int, cache: RecordCache | None = None) -> CapabilityRecord:
    """Check every rule in the module docstring; raise RecordRejected(reason) on the first broken.

    With ``cache``: a record these exact bytes already passed as is re-checked
    against the clock only (rule 7), and a record that passes is remembered."""
    if cache is not None:
        known = cache.get(data)
        if known is not None:
            check_lifetime(known.payload, now_ms)
            return known
    payload = open_signed(data, pb.RECORD_KIND_CAPABILITY, pb.CapabilityPayload)
    _check_bounds(payload)
    issued, expires = check_lifetime(payload, now_ms)
    r = payload.shard_range
    rec = CapabilityRecord(raw=data, peer_id=payload.peer_id, sequence=payload.sequence,
                           model_artifact_digest=payload.model_artifact_digest,
                           start_layer=r.start_layer, end_layer=r.end_layer,
                           num_layers=payload.num_layers, issued_at_ms=issued, expires_at_ms=expires,
                           withdrawn=payload.withdrawn, payload=payload)
    if cache is not None:
        cache.put(rec)
    return rec


def _runs_problem(runs, num_layers: int) -> str | None:
    if len(runs) > MAX_DELEGATED_RUNS:
        return f"over {MAX_DELEGATED_RUNS} delegated expert runs"
    for run in runs:
        if not run.first_layer <= run.last_layer < num_layers:
            return f"delegated layer run {run.first_layer}..{run.last_layer} of {num_layers} layers"
        if run.routed and not run.first_expert <= run.last_expert <= MAX_EXPERT_ID:
            return f"delegated expert run {run.first_expert}..{run.last_expert}"
        if not (run.routed or run.shared):
            return "an empty delegated expert run"
    return None


def _check_bounds(p: pb.CapabilityPayload) -> None:
    def bad(detail: str) -> RecordRejected:
        return RecordRejected("malformed", detail)

    problem = _runs_problem(p.delegated_experts, p.num_layers)
    if problem:
        raise bad(problem)

    if not DIGEST_RE.match(p.model_artifact_digest):
        raise bad("model_artifact_digest has a bad form")
    if p.runtime_recipe_digest and not DIGEST_RE.match(p.runtime_recipe_digest):
        raise bad("runtime_recipe_digest has a bad form")
    r = p.shard_range
    if p.withdrawn:
        if r.start_layer or r.end_layer:
            raise bad("a withdrawal carries an empty range")
    elif not 0 <= r.start_layer < r.end_layer <= p.num_layers <= MAX_LAYERS:
        raise bad(f"range {r.start_layer}:{r.end_layer} of {p.num_layers} layers")
    reach = p.reachability
    if len(reach.direct_addrs) > MAX_DIRECT_ADDRS or len(reach.relayed_addrs) > MAX_RELAYED_ADDRS:
        raise bad("too many addresses")
    if any(len(a) > MAX_ADDR_CHARS for a in list(reach.direct_addrs) + list(reach.relayed_addrs)):
        raise bad("address too long")
    if len(reach.grpc_endpoint) > MAX_ENDPOINT_CHARS:
        raise bad("grpc_endpoint too long")
    if reach.tls_cert_sha256 and len(reach.tls_cert_sha256) != 32:
        raise bad("tls_cert_sha256 must be 32 bytes")
    if reach.grpc_endpoint and len(reach.tls_cert_sha256) != 32:
        raise bad("a grpc_endpoint needs its certificate hash (tls_cert_sha256)")
    if len(reach.frames_endpoint) > MAX_ENDPOINT_CHARS:
        raise bad("frames_endpoint too long")
    if reach.frames_endpoint and not reach.grpc_endpoint:
        raise bad("a frames_endpoint is a fast path beside a grpc_endpoint (the fallback), never alone")
    if len(p.model_id) > MAX_MODEL_ID_CHARS or len(p.dtypes) > MAX_DTYPES:
        raise bad("model_id or dtypes over bound")
    if len(reach.fetch_endpoint) > MAX_ENDPOINT_CHARS:
        raise bad("fetch_endpoint too long")
    if reach.fetch_endpoint and len(reach.tls_cert_sha256) != 32:
        raise bad("a fetch_endpoint needs its certificate hash (tls_cert_sha256)")
    if p.held_end and not 0 <= p.held_start < p.held_end <= p.num_layers:
        raise bad(f"held layers {p.held_start}:{p.held_end} of {p.num_layers}")
    if len(p.artifact_sha256) > MAX_DIGEST_CHARS or (p.artifact_sha256 and not DIGEST_RE.match(p.artifact_sha256)):
        raise bad("artifact_sha256 has a bad form")


def replaces(incoming: CapabilityRecord, existing: CapabilityRecord | None) -> bool:
    """True when ``incoming`` should replace ``existing`` (same peer, higher sequence)."""
    if existing is None:
        return True
    if incoming.peer_id != existing.peer_id:
        raise ValueError("records of different peers never replace each other")
    return incoming.sequence > existing.sequence


def check_replaces(incoming: CapabilityRecord, existing: CapabilityRecord | None) -> None:
    if not replaces(incoming, existing):
        assert existing is not None
        raise RecordRejected("replayed", f"sequence {incoming.sequence} <= stored {existing.sequence}")


# --------------------------------------------------------------------------- record sets


class _Packable(Protocol):
    """What a record set packs of a record (capability, relay and expert records alike)."""

    @property
    def raw(self) -> bytes: ...

    @property
    def peer_id(self) -> str: ...


def encode_record_set(records: Sequence[_Packable]) -> bytes:
    if len(records) > MAX_INDEX_RECORDS:
        raise ValueError(f"{len(records)} records > MAX_INDEX_RECORDS")
    parts = [SET_MAGIC, _U16.pack(len(records))]
    for rec in sorted(records, key=lambda r: r.peer_id):
        parts += [_U32.pack(len(rec.raw)), rec.raw]
    return b"".join(parts)


def decode_record_set(data: bytes) -> list[bytes]:
    """Split an encoded set into record bytes; bounded before any slicing."""
    if len(data) > len(SET_MAGIC) + 2 + MAX_INDEX_RECORDS * (4 + MAX_RECORD_BYTES):
        raise RecordRejected("too_large", f"record set of {len(data)} bytes")
    if len(data) < 6 or data[:4] != SET_MAGIC:
        raise RecordRejected("malformed", "not a meshd record set")
    (count,) = _U16.unpack_from(data, 4)
    if count > MAX_INDEX_RECORDS:
        raise RecordRejected("too_large", f"{count} records > {MAX_INDEX_RECORDS}")
    offset, out = 6, []
    for _ in range(count):
        if offset + 4 > len(data):
            raise RecordRejected("malformed", "truncated record set")
        (length,) = _U32.unpack_from(data, offset)
        offset += 4
        if length > MAX_RECORD_BYTES:
            raise RecordRejected("too_large", f"record of {length} bytes in a set")
        if offset + length > len(data):
            raise RecordRejected("malformed", "truncated record set")
        out.append(data[offset:offset + length])
        offset += length
    if offset != len(data):
        raise RecordRejected("malformed", "trailing bytes after the record set")
    return out


def validate_record_set(data: bytes, now_ms: int, cache: RecordCache | None = None) -> list[CapabilityRecord]:
    """Strict: every record valid and at most one per peer, else RecordRejected."""
    records = [validate_capability(raw, now_ms, cache) for raw in decode_record_set(data)]
    peers = [r.peer_id for r in records]
    if len(set(peers)) != len(peers):
        raise RecordRejected("malformed", "two records of one peer in a set")
    return records


def parse_record_set_lenient(data: bytes, now_ms: int, cache: RecordCache | None = None) -> list[CapabilityRecord]:
    """For reading stored sets: drop records that expired since they were stored.

    Any record broken in another way (forged, future, unknown schema) makes
    the whole set suspect -- an honest store never accepted it -- so the set
    is refused.
    """
    out = []
    for raw in decode_record_set(data):
        try:
            out.append(validate_capability(raw, now_ms, cache))
        except RecordRejected as exc:
            if exc.reason != "expired":
                raise
    return out


def merge_records(current: Iterable[CapabilityRecord], incoming: Iterable[CapabilityRecord],
                  now_ms: int) -> list[CapabilityRecord]:
    """One record per peer (highest sequence), unexpired, at most MAX_INDEX_RECORDS.

    When over the bound, live records win over withdrawals, then the ones
    that expire last.
    """
    best: dict[str, CapabilityRecord] = {}
    for rec in list(current) + list(incoming):
        if rec.expired(now_ms):
            continue
        held = best.get(rec.peer_id)
        if held is None or rec.sequence > held.sequence:
            best[rec.peer_id] = rec
    ranked = sorted(best.values(), key=lambda r: (r.withdrawn, -r.expires_at_ms, r.peer_id))
    return sorted(ranked[:MAX_INDEX_RECORDS], key=lambda r: r.peer_id)


def news(candidate: Iterable[CapabilityRecord], others: Iterable[CapabilityRecord]) -> int:
    """How many records of ``candidate`` are newer than anything ``others`` hold for that peer."""
    held: dict[str, int] = {}
    for rec in others:
        held[rec.peer_id] = max(held.get(rec.peer_id, -1), rec.sequence)
    return sum(1 for rec in candidate if rec.sequence > held.get(rec.peer_id, -1))


def live(records: Iterable[CapabilityRecord], now_ms: int) -> list[CapabilityRecord]:
    """The records that advertise something now: unexpired and not withdrawn."""
    return [r for r in records if not r.withdrawn and not r.expired(now_ms)]
