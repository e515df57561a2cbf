"""Helpers for the daemon tests: identities, claims, forged-record factories."""
from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dht.identity import Identity
from dht.records import CapabilityClaim, sign_capability
from proto import shard_runtime_pb2 as pb
from proto.records import sign_record

REPO_ROOT = Path(__file__).resolve().parent.parent
DIGEST = "sha256:" + "ab" * 32
NOW_MS = 1_800_000_000_000
TTL_MS = 60_000


def identity(seed_byte: int) -> Identity:
    return Identity.from_seed(bytes([seed_byte]) * 32)


def claim(start: int = 0, end: int = 4, num_layers: int = 8, digest: str = DIGEST) -> CapabilityClaim:
    return CapabilityClaim(model_artifact_digest=digest, runtime_recipe_digest="recipe-1",
                           start_layer=start, end_layer=end, num_layers=num_layers,
                           grpc_endpoint="127.0.0.1:5000", tls_cert_sha256=b"\x01" * 32,
                           direct_addrs=("/ip4/127.0.0.1/tcp/4001",))


def good(ident: Identity, *, seq: int = 10, now: int = NOW_MS, ttl: int = TTL_MS, **kw) -> bytes:
    return sign_capability(claim(**kw), ident.signing_key, peer_id=ident.peer_id, sequence=seq,
                           now_ms=now, ttl_ms=ttl)


def raw_payload(ident: Identity, *, seq: int = 10, now: int = NOW_MS, ttl: int = TTL_MS,
                schema: int = pb.SCHEMA_VERSION_1, peer_id: str | None = None,
                digest: str = DIGEST) -> pb.CapabilityPayload:
    return pb.CapabilityPayload(
        schema_version=schema, peer_id=peer_id or ident.peer_id, model_artifact_digest=digest,
        runtime_recipe_digest="recipe-1",
        shard_range=pb.ShardRange(start_layer=0, end_layer=4), num_layers=8,
        issued_at_unix_ms=now, expires_at_unix_ms=now + ttl, sequence=seq)


def signed(payload: pb.CapabilityPayload, key: Ed25519PrivateKey) -> bytes:
    return sign_record(pb.RECORD_KIND_CAPABILITY, payload.SerializeToString(), key).SerializeToString()


def forged_records(victim: Identity, attacker: Identity, now: int = NOW_MS, *, digest: str = DIGEST,
                   high_seq: int = 99, replay_seq: int = 5) -> dict[str, bytes]:
    """The refusal table: name -> record bytes that must be refused at time ``now``.

    Every forgery claims a sequence (``high_seq``) that would win if accepted.
    ``replayed`` is validly signed; it must be refused relative to the stored
    record, whose sequence is above ``replay_seq``.
    """
    forged_sig = pb.SignedRecord.FromString(good(victim, now=now, digest=digest))
    forged_sig.payload = raw_payload(victim, seq=high_seq, now=now, digest=digest).SerializeToString()
    return {
        "forged_signature": forged_sig.SerializeToString(),  # signature of another payload
        "key_peer_id_mismatch": signed(raw_payload(victim, seq=high_seq, now=now, digest=digest),
                                       attacker.signing_key),
        "expired": good(victim, seq=high_seq, now=now - 2 * TTL_MS, ttl=TTL_MS, digest=digest),
        "future_dated": good(victim, seq=high_seq, now=now + 3_600_000, digest=digest),
        "unknown_schema": signed(raw_payload(victim, seq=high_seq, now=now, schema=7, digest=digest),
                                 victim.signing_key),
        "replayed": good(victim, seq=replay_seq, now=now, digest=digest),
    }


def as_record_set(raw: bytes) -> bytes:
    """Wrap raw record bytes in a one-record set without validating them."""
    return b"MSR1" + (1).to_bytes(2, "big") + len(raw).to_bytes(4, "big") + raw


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *inherited])
    return env
