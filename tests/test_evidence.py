"""Evidence records (dht/evidence.py) and a second entry's re-verification (meshd/generate/evidence.py).

Shards in memory named by real libp2p peer ids (their node keys sign their receipt
keys): A [0,2), T [4,6), and three servers of [2,4): an honest pair H, H2 and the
liar L. Entry 1 audits every step and keeps an accusation; entry 2 validates the
signed record and recomputes the step on hops it chose.
"""
from __future__ import annotations

import dataclasses

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.errors import RecordRejected
from dht.evidence import EVIDENCE_LIFETIME_MS, MAX_EVIDENCE_TOKENS, sign_evidence, validate_evidence
from dht.identity import peer_id_from_public_key
from dht.records import MAX_RECORD_BYTES
from meshd.generate.audit import AuditBook, VerifyPolicy
from meshd.generate.driver import collect
from meshd.generate.evidence import Accusation, Verdict, consider, reverify
from meshd.generate.receipt_check import ReceiptCheck
from meshd.plan.routing import Hop
from meshd.testing.liar import LyingBackend, Perturb
from proto.receipts import ReceiptSigner
from proto.records import public_key_bytes
from shard.model.torch_backend import TorchRangeBackend
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy
from tests._swarm_helpers import KV_BUDGET_TOKENS, MemoryShard, MemorySwarm, whole_tokens
from tests._swarm_helpers import request as make_request

NOW_MS = 1_800_000_000_000
NEW_TOKENS = 6
KEYS = {n: Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32)
        for i, n in enumerate(("a", "l", "h", "h2", "t", "entry1", "entry2"))}
ID = {n: peer_id_from_public_key(public_key_bytes(k)) for n, k in KEYS.items()}
CHECK = ReceiptCheck(now_ms=lambda: NOW_MS)      # binds libp2p peer ids to their node keys
DIGEST = "m" * 64


def build(costs: dict[str, float]) -> MemorySwarm:
    swarm = MemorySwarm()
    for name, start, end in (("a", 0, 2), ("h", 2, 4), ("h2", 2, 4), ("t", 4, 6)):
        swarm.start(ID[name], start, end, cost=costs.get(name, 1.0))
    liar = LyingBackend(TorchRangeBackend.load(swarm.model, 2, 4), Perturb(share=1.0, seed=9))
    service = ShardService(liar, SessionPolicy(kv_budget_tokens=KV_BUDGET_TOKENS))
    endpoint = "mem-liar:evidence"
    swarm.shards[ID["l"]] = MemoryShard(ID["l"], 2, 4, service, swarm.network.add(endpoint, service), endpoint)
    swarm.costs[ID["l"]] = costs["l"]
    for name in ("a", "l", "h", "h2", "t"):
        swarm[ID[name]].service.receipts = ReceiptSigner.fresh(ID[name], KEYS[name], NOW_MS)
    return swarm


def accuse(swarm: MemorySwarm) -> tuple[Accusation, bytes]:
    """Entry 1: audit every step; its book's first accusation, signed."""
    book = AuditBook()
    driver = swarm.driver(verify=VerifyPolicy(1.0, seed=1), audit_book=book, receipts=CHECK)
    assert collect(driver, make_request(NEW_TOKENS)) == whole_tokens(NEW_TOKENS)
    accusation = book.accusations[0]
    return accusation, accusation.sign(KEYS["entry1"], accuser=ID["entry1"], model_digest=DIGEST,
                                       recipe_digest="", num_layers=6, now_ms=NOW_MS)


def hop(swarm: MemorySwarm, name: str, effective_start: int) -> Hop:
    s = swarm[ID[name]]
    return Hop(ID[name], s.start, s.end, effective_start, False, s.endpoint)


def entry2(swarm: MemorySwarm, replica: str):
    """Entry 2's recomputation: A for [0, 2), ``replica`` for [2, 4)."""
    def recompute(ev):
        return reverify(ev, prefix=[hop(swarm, "a", 0)], replica=hop(swarm, replica, 2),
                        transport=lambda h: swarm.network.transport(h.endpoint), fingerprint=swarm.fingerprint,
                        receipts=CHECK)
    return recompute


def test_a_second_entry_excludes_the_liar_after_recomputing_the_step():
    swarm = build({"l": 0.5, "h": 5.0, "h2": 6.0})
    accusation, record = accuse(swarm)
    assert accusation.accused == ID["l"]
    assert len(record) <= MAX_RECORD_BYTES
    ev = validate_evidence(record, NOW_MS + 1000)
    assert ev.accused == ID["l"] and ev.accuser == ID["entry1"] and ev.auditor == ID["h"]
    book = AuditBook()
    verdict = consider(record, now_ms=NOW_MS + 1000, recompute=entry2(swarm, "h2"), exclude=book.exclude)
    assert verdict is Verdict.CONFIRMED and list(book.excluded) == [ID["l"]]
    assert swarm.idle()          # the recomputation's sessions are released
    with pytest.raises(Exception, match="neither the accused nor"):
        entry2(swarm, "h")(ev)   # the accuser's own auditor is not asked again


def test_a_record_framing_an_honest_peer_is_cleared_by_recomputation():
    """The accuser's auditor is the liar: entry 1 excludes honest H locally, and its record against
    H passes every model-free rule -- but entry 2's recomputation clears H."""
    swarm = build({"h": 0.5, "l": 5.0, "h2": 6.0})
    accusation, record = accuse(swarm)
    assert accusation.accused == ID["h"]
    validate_evidence(record, NOW_MS)
    book = AuditBook()
    verdict = consider(record, now_ms=NOW_MS, recompute=entry2(swarm, "h2"), exclude=book.exclude)
    assert verdict is Verdict.CLEARED and not book.excluded


def _resign(accusation: Accusation, key=KEYS["entry1"], accuser=ID["entry1"], **changes) -> bytes:
    fields = dict(accused=accusation.accused, model_digest=DIGEST, recipe_digest="", num_layers=6,
                  accused_receipt=accusation.accused_receipt.to_bytes(), accused_key=accusation.accused_key,
                  auditor_receipt=accusation.auditor_receipt.to_bytes(), auditor_key=accusation.auditor_key,
                  token_ids=accusation.token_ids, prompt_tokens=accusation.prompt_tokens,
                  chunk_tokens=accusation.chunk_tokens, sampling=accusation.sampling, now_ms=NOW_MS)
    fields.update(changes)
    return sign_evidence(key, accuser=accuser, **fields)  # type: ignore[arg-type]


REASONS = {"signature": "signature", "peer_id": "peer id",
           "accused's node": "accused's node key", "self-audit": "the auditor is the accused",
           "1..": "token ids", "outside": "outside"}


def test_forged_or_malformed_records_are_rejected_before_any_recomputation():
    swarm = build({"l": 0.5, "h": 5.0, "h2": 6.0})
    accusation, record = accuse(swarm)
    assert validate_evidence(_resign(accusation), NOW_MS)
    forged = bytearray(record)
    forged[-5] ^= 1
    cases = {
        "signature": bytes(forged),
        "peer_id": _resign(accusation, accuser=ID["entry2"]),                  # signed by entry1 as entry2
        "accused's node": _resign(accusation, accused=ID["h2"]),                # the receipt is not H2's
        "self-audit": _resign(accusation, auditor_receipt=accusation.accused_receipt.to_bytes(),
                              auditor_key=accusation.accused_key),
        "1..": _resign(accusation, token_ids=(1,) * (MAX_EVIDENCE_TOKENS + 1)),
        "outside": _resign(accusation, token_ids=accusation.token_ids[:3], prompt_tokens=3),
    }
    for what, data in cases.items():
        with pytest.raises(RecordRejected, match=REASONS[what]):
            validate_evidence(data, NOW_MS)
    with pytest.raises(RecordRejected, match="expired"):
        validate_evidence(record, NOW_MS + EVIDENCE_LIFETIME_MS + 1)
    with pytest.raises(RecordRejected, match="future"):
        validate_evidence(record, NOW_MS - 3_600_000)
    # a receipt whose signature was altered inside an otherwise well-signed record
    bad = dataclasses.replace(accusation.accused_receipt, signature=bytes(64))
    with pytest.raises(RecordRejected, match="accused"):
        validate_evidence(_resign(accusation, accused_receipt=bad.to_bytes()), NOW_MS)
    book = AuditBook()
    with pytest.raises(RecordRejected):
        consider(bytes(forged), now_ms=NOW_MS, recompute=entry2(swarm, "h2"), exclude=book.exclude)
    assert not book.excluded


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000))
def test_fuzz_evidence_bytes_give_a_typed_refusal(data):
    with pytest.raises(RecordRejected):
        validate_evidence(data, NOW_MS)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**32 - 1), st.binary(max_size=300), st.binary(max_size=300))
def test_fuzz_well_signed_payloads_give_a_typed_refusal(tokens, prompt, chunk, layers, receipt, other):
    """Whatever a signer puts in the payload: a valid Evidence or a RecordRejected, never another error."""
    from proto import shard_runtime_pb2 as pb
    from proto.frames import SCHEMA_VERSION

    payload = pb.EvidencePayload(schema_version=SCHEMA_VERSION, peer_id=ID["entry1"], accused_peer_id=ID["l"],
                                 model_artifact_digest=DIGEST, num_layers=layers, accused_receipt=receipt,
                                 auditor_receipt=other, token_ids=tokens, prompt_tokens=prompt, chunk_tokens=chunk,
                                 issued_at_unix_ms=NOW_MS, expires_at_unix_ms=NOW_MS + 1000)
    from dht.records import sign_payload

    with pytest.raises(RecordRejected):
        validate_evidence(sign_payload(pb.RECORD_KIND_EVIDENCE, payload, KEYS["entry1"]), NOW_MS)
