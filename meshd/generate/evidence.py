"""Evidence at the entry: what an audit mismatch leaves behind, and a second entry's recomputation.

    Accusation   what StepAuditor keeps when an audit disagrees and both peers signed
                 receipts: the pair of receipts of the first step whose outputs differ
                 (same layers, positions, input digest and input history), both keys'
                 certificates, and the recipe to recompute it -- the head's token
                 history, the prompt's length and chunking, a tail's sampling.
                 ``sign`` makes it a DHT evidence record (dht/evidence.py).
    reverify     another entry's check of a validated record before it excludes anyone:
                 it feeds the token history through hops it chose (never the accused,
                 nor the accuser's auditor) in the batches the original route used, up to
                 the accused step, on a replica of the accused's layers, and reads the
                 replica's own receipt of that step:

                     replica history != accused history   UNCONFIRMED (the accused was fed
                                                          other inputs than the tokens give,
                                                          or the lane is not exact): no action
                     replica output == accused output     CLEARED: the accused told the truth,
                                                          the record is false
                     otherwise                            CONFIRMED: exclude the accused

The recomputation runs synchronously on its own sessions (ids ``<id>.reverify``)
and releases them; it never trusts the record's numbers beyond what the
receipts' signatures bind.
"""
from __future__ import annotations

import enum
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dht.evidence import Evidence, sign_evidence, validate_evidence
from meshd.errors import HopFailure
from meshd.generate.hop_link import HopLink, LinkSpec, StepCounter
from meshd.generate.receipt_check import ReceiptCheck
from meshd.plan.routing import Hop
from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError
from proto.hop_transport import HopTransport
from proto.receipts import Delegation, SignedReceipt


@dataclass(frozen=True, slots=True)
class Accusation:
    """An audit mismatch both peers signed receipts for (see the module doc)."""

    accused: str
    accused_receipt: SignedReceipt
    accused_key: Delegation
    auditor_receipt: SignedReceipt
    auditor_key: Delegation
    token_ids: tuple[int, ...]
    prompt_tokens: int
    chunk_tokens: int
    sampling: pb.SamplingParams

    @classmethod
    def of(cls, accused: HopLink, auditor: HopLink, *, token_ids: Sequence[int], prompt_tokens: int,
           chunk_tokens: int, sampling: pb.SamplingParams) -> Accusation | None:
        """The accusation of the audited step's first differing receipt pair (None: no pair)."""
        if accused.delegation is None or auditor.delegation is None:
            return None
        for a, b in zip(accused.receipts, auditor.receipts):
            ra, rb = a.receipt, b.receipt
            same = (ra.start, ra.end, ra.first_position, ra.count, ra.input_sha256, ra.history_sha256) == \
                (rb.start, rb.end, rb.first_position, rb.count, rb.input_sha256, rb.history_sha256)
            if same and ra.output_sha256 != rb.output_sha256:
                upto = ra.first_position + ra.count     # a prompt cut short batches the same chunks
                return cls(accused.spec.peer_id, a, accused.delegation, b, auditor.delegation,
                           tuple(int(t) for t in token_ids[:upto]), min(prompt_tokens, upto), chunk_tokens, sampling)
        return None

    def sign(self, key, *, accuser: str, model_digest: str, recipe_digest: str, num_layers: int,
             now_ms: int) -> bytes:
        return sign_evidence(key, accuser=accuser, accused=self.accused, model_digest=model_digest,
                             recipe_digest=recipe_digest, num_layers=num_layers,
                             accused_receipt=self.accused_receipt.to_bytes(), accused_key=self.accused_key,
                             auditor_receipt=self.auditor_receipt.to_bytes(), auditor_key=self.auditor_key,
                             token_ids=self.token_ids, prompt_tokens=self.prompt_tokens,
                             chunk_tokens=self.chunk_tokens, sampling=self.sampling, now_ms=now_ms)


class Verdict(enum.Enum):
    CONFIRMED = "confirmed"
    CLEARED = "cleared"
    UNCONFIRMED = "unconfirmed"


def replay_batches(past: int, target: int, prompt: int) -> list[tuple[int, int]]:
    """The batches a route fed [past, target) in: the prompt as one prefill, then one position per
    step (the route driver's ``_replay``: some kernels are not batch-invariant)."""
    batches = [(past, min(prompt, target))] if past < prompt else []
    return batches + [(p, p + 1) for p in range(max(past, prompt), target)]


def reverify(ev: Evidence, *, prefix: Sequence[Hop], replica: Hop, transport: Callable[[Hop], HopTransport],
             fingerprint: pb.Fingerprint, receipts: ReceiptCheck) -> Verdict:
    """Recompute the accused step of ``ev`` through ``prefix`` (hops covering [0, its start layer))
    and ``replica`` (its layers); the verdict of the module doc."""
    step = ev.step
    peers = {h.peer_id for h in (*prefix, replica)}
    if ev.accused in peers or ev.auditor in peers:
        raise LocalError("a re-verification uses neither the accused nor the accuser's auditor")
    if replica.effective_start != step.start or replica.end != step.end:
        raise LocalError("the replica must run exactly the accused step's layers")
    if [(h.effective_start, h.end) for h in prefix] != _cover(prefix, step.start):
        raise LocalError("the prefix must run layers [0, the accused step's start) in order")
    session = f"{uuid.uuid4().hex}.reverify"
    target = step.first_position + step.count
    secret = os.urandom(32)

    def link(i: int, hop: Hop) -> HopLink:
        tail = hop.end == ev.num_layers
        spec = LinkSpec(peer_id=hop.peer_id, start=hop.start, end=hop.end, effective_start=hop.effective_start,
                        num_layers=ev.num_layers, session_id=session, epoch=0, fingerprint=fingerprint,
                        chunk_tokens=ev.chunk_tokens, max_tokens=target + 1,
                        tail=pb.TailOptions(sample=True, sampling=ev.sampling) if tail else None,
                        owner_token=secret)
        made = HopLink(i, spec, lambda: transport(hop))
        made.receipt_check = receipts
        return made

    links = [link(i, h) for i, h in enumerate((*prefix, replica))]
    counter = StepCounter()
    tokens = np.asarray(ev.token_ids, dtype=np.int64)
    try:
        for link_ in links:
            link_.open()
        for a, b in replay_batches(0, target, ev.prompt_tokens):
            rows: object = tokens[a:b]
            for link_ in links:
                rows = link_.run(rows, counter)   # type: ignore[arg-type]
            for signed in links[-1].receipts:
                r = signed.receipt
                if (r.first_position, r.count) == (step.first_position, step.count):
                    if r.history_sha256 != step.history_sha256 or r.input_sha256 != step.input_sha256:
                        return Verdict.UNCONFIRMED
                    return Verdict.CLEARED if r.output_sha256 == step.output_sha256 else Verdict.CONFIRMED
        return Verdict.UNCONFIRMED    # the replica signed no receipt of that step
    except HopFailure:
        return Verdict.UNCONFIRMED
    finally:
        for link_ in links:
            link_.close(release=True)


def _cover(prefix: Sequence[Hop], start: int) -> list[tuple[int, int]]:
    """The (effective start, end) pairs a prefix covering [0, start) in order has."""
    spans, at = [], 0
    for hop in prefix:
        spans.append((at, hop.end))
        at = hop.end
    return spans if at == start else []


def consider(record: bytes, *, now_ms: int, recompute: Callable[[Evidence], Verdict],
             exclude: Callable[[str, str], None]) -> Verdict:
    """A second entry's whole treatment of an evidence record read from the DHT: the model-free
    rules (dht/evidence.py; RecordRejected), then ``recompute`` (``reverify`` over hops this entry
    chose); only a CONFIRMED verdict excludes the accused (``exclude(peer, why)``)."""
    ev = validate_evidence(record, now_ms)
    verdict = recompute(ev)
    if verdict is Verdict.CONFIRMED:
        step = ev.step
        exclude(ev.accused, f"evidence from {ev.accuser[:16]} re-verified: layers [{step.start}, {step.end}) "
                            f"positions [{step.first_position}, {step.first_position + step.count})")
    return verdict
