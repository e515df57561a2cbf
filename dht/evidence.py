"""Evidence records: an entry's signed claim that a peer answered a step otherwise than a replica.

An evidence record is a ``pb.SignedRecord`` (kind EVIDENCE) whose payload is
a ``pb.EvidencePayload``, signed by the accusing entry's node key:

    the accused's receipt of the step and its key's certificate
    the auditor's receipt of the same step and its key's certificate
    the head's input history (token ids), the prompt's length and chunking,
    a tail's sampling -- what anyone needs to recompute the step
    issue time and expiry (a record with a bounded life, like every DHT record)

Why it cannot frame an honest peer: both receipts are signed by the peers
themselves (keys certified by their node keys, bound to their peer ids), so
the accuser can neither invent the accused's answer nor its inputs; both name
the same layers, positions, input digest and input *history* (every input
digest of the session chained), and different outputs. Whether the accused
or the auditor lied is then a matter of recomputation, which another entry
does itself before it acts (meshd/generate/evidence.py): it feeds the token
history through peers it chooses, checks that the accused's recorded history
is what those tokens give, and compares the accused's output with its own
replica's. This module only checks what needs no model (``validate_evidence``):

1. the shared SignedRecord rules (dht/records.py ``open_signed``: size, kind,
   signature, schema, the signing key is the accuser's peer id);
2. the lifetime rules (not future-dated, at most MAX_RECORD_LIFETIME_MS, not expired);
3. bounds: at most MAX_EVIDENCE_TOKENS token ids, a prompt within them, chunking
   and layers in range;
4. each receipt verifies under its certificate, each certificate under a node key
   -- the accused's peer id for the accused, another key for the auditor --, both
   unexpired when the evidence was issued;
5. the receipts agree on layers, positions, input digest and history, and
   disagree on the output; the receipts' positions lie inside the token history.

Any failure is a ``RecordRejected`` naming the rule.
"""
from __future__ import annotations

from dataclasses import dataclass

from dht.errors import RecordRejected
from dht.identity import peer_id_from_public_key
from dht.records import DIGEST_RE, check_lifetime, open_signed, sign_payload
from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolError
from proto.frames import SCHEMA_VERSION
from proto.receipts import (
    Delegation,
    Receipt,
    SignedReceipt,
    parse_delegation,
    parse_signed_receipt,
    verify_delegation,
    verify_receipt,
)

__all__ = ["Evidence", "sign_evidence", "validate_evidence", "MAX_EVIDENCE_TOKENS", "EVIDENCE_LIFETIME_MS"]

# Token ids a record carries: a record is at most MAX_RECORD_BYTES (4 KiB); two receipts and two
# certificates take ~900 bytes, and ids of vocabularies up to 2M are varints of <= 3 bytes. A liar
# caught later in a longer generation is excluded locally; its accusation is not published.
MAX_EVIDENCE_TOKENS = 900
# An accusation outlives the liar's records long enough for other entries to read it; a peer
# that was wrongly accused is cleared by re-verification anyway.
EVIDENCE_LIFETIME_MS = 3600 * 1000
# Bounds of the recomputation recipe (a prefill chunk is at most this many tokens; DHT layer bound).
MAX_CHUNK_TOKENS = 4096
MAX_EVIDENCE_LAYERS = 1 << 16


@dataclass(frozen=True, slots=True)
class Evidence:
    """A validated evidence record's contents (``validate_evidence``)."""

    accuser: str
    accused: str
    model_digest: str
    recipe_digest: str
    num_layers: int
    accused_receipt: SignedReceipt
    accused_key: Delegation
    auditor_receipt: SignedReceipt
    auditor_key: Delegation
    token_ids: tuple[int, ...]
    prompt_tokens: int
    chunk_tokens: int
    sampling: pb.SamplingParams
    issued_at_ms: int
    expires_at_ms: int

    @property
    def step(self) -> Receipt:
        return self.accused_receipt.receipt

    @property
    def auditor(self) -> str:
        return peer_id_from_public_key(self.auditor_key.node_public_key)


def sign_evidence(key, *, accuser: str, accused: str, model_digest: str, recipe_digest: str, num_layers: int,
                  accused_receipt: bytes, accused_key: Delegation, auditor_receipt: bytes, auditor_key: Delegation,
                  token_ids: list[int] | tuple[int, ...], prompt_tokens: int, chunk_tokens: int,
                  sampling: pb.SamplingParams, now_ms: int, lifetime_ms: int = EVIDENCE_LIFETIME_MS) -> bytes:
    """The serialized record (ValueError when it would be over MAX_RECORD_BYTES)."""
    payload = pb.EvidencePayload(
        schema_version=SCHEMA_VERSION, peer_id=accuser, accused_peer_id=accused, model_artifact_digest=model_digest,
        recipe_digest=recipe_digest, num_layers=num_layers, accused_receipt=accused_receipt,
        accused_key=accused_key.to_pb(), auditor_receipt=auditor_receipt, auditor_key=auditor_key.to_pb(),
        token_ids=list(token_ids), prompt_tokens=prompt_tokens, chunk_tokens=chunk_tokens, sampling=sampling,
        issued_at_unix_ms=now_ms, expires_at_unix_ms=now_ms + lifetime_ms)
    return sign_payload(pb.RECORD_KIND_EVIDENCE, payload, key)


def _receipt(data: bytes, key: pb.KeyDelegation, issued_ms: int, who: str) -> tuple[SignedReceipt, Delegation]:
    try:
        delegation = parse_delegation(key)
        signed = parse_signed_receipt(data)
        verify_receipt(signed, delegation)
    except ProtocolError as exc:
        raise RecordRejected("signature", f"the {who}'s receipt: {exc}") from exc
    try:
        verify_delegation(delegation, issued_ms)      # certified, and not expired when the step was accused
    except ProtocolError as exc:
        raise RecordRejected("signature", f"the {who}'s receipt key: {exc}") from exc
    return signed, delegation


def validate_evidence(data: bytes, now_ms: int) -> Evidence:
    """The record's contents once every model-free rule passed (module doc); RecordRejected if not."""
    p = open_signed(data, pb.RECORD_KIND_EVIDENCE, pb.EvidencePayload)
    issued, expires = check_lifetime(p, now_ms)
    if not DIGEST_RE.match(p.model_artifact_digest) or (p.recipe_digest and not DIGEST_RE.match(p.recipe_digest)):
        raise RecordRejected("malformed", "the model and recipe digests must be well-formed")
    if not 0 < len(p.token_ids) <= MAX_EVIDENCE_TOKENS or not 0 < p.prompt_tokens <= len(p.token_ids):
        raise RecordRejected("malformed", f"1..{MAX_EVIDENCE_TOKENS} token ids, the prompt among them")
    if not 0 < p.chunk_tokens <= MAX_CHUNK_TOKENS or not 0 < p.num_layers <= MAX_EVIDENCE_LAYERS:
        raise RecordRejected("malformed", "chunk tokens and layers out of range")
    accused, accused_key = _receipt(p.accused_receipt, p.accused_key, issued, "accused")
    auditor, auditor_key = _receipt(p.auditor_receipt, p.auditor_key, issued, "auditor")
    if peer_id_from_public_key(accused_key.node_public_key) != p.accused_peer_id:
        raise RecordRejected("peer_id", "the accused receipt's key is not certified by the accused's node key")
    if auditor_key.node_public_key == accused_key.node_public_key:
        raise RecordRejected("malformed", "the auditor is the accused")
    a, b = accused.receipt, auditor.receipt
    if (a.start, a.end, a.first_position, a.count, a.input_sha256, a.history_sha256) != \
            (b.start, b.end, b.first_position, b.count, b.input_sha256, b.history_sha256):
        raise RecordRejected("malformed", "the receipts are not of the same step with the same inputs")
    if a.output_sha256 == b.output_sha256:
        raise RecordRejected("malformed", "the receipts agree: there is nothing to accuse")
    if a.end > p.num_layers or a.first_position + a.count > len(p.token_ids):
        raise RecordRejected("malformed", "the step lies outside the model or the token history")
    return Evidence(p.peer_id, p.accused_peer_id, p.model_artifact_digest, p.recipe_digest, p.num_layers,
                    accused, accused_key, auditor, auditor_key, tuple(p.token_ids), p.prompt_tokens,
                    p.chunk_tokens, p.sampling, issued, expires)
