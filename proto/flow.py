"""Application-level flow control: negotiation and credit accounting (sans-I/O).

Why: HTTP/2 windows bound bytes, not queued work, and a relayed frame has no
window at all. Each ActivationChunk or DecodeStep the sender sends consumes one
credit; the receiver hands credits back with ``FlowControl{credits_granted: n}``
(a delta) when it is ready for more work.

Negotiation (``negotiate``): for every bound the strictest (smallest) nonzero
value of the two sides wins; 0 means "no preference"; when neither states one
the default from limits.py applies; hard caps apply last. The initial credit
never exceeds the negotiated ``max_inflight_chunks``.

Invariant, both sides: credits the sender holds + chunks the receiver holds
<= max_inflight_chunks.
    CreditWindow (sender):   .available credits, .inflight (sent, not yet acked);
                             consume() before sending, on_ack() per Ack/DecodeResult,
                             on_grant(n) per FlowControl message from the receiver.
    CreditLedger (receiver): on_chunk() per chunk received (FlowControlViolation
                             without credit), grant(queued=0) -> n to send back
                             once it has room (0: send nothing).
"""
from __future__ import annotations

from proto import shard_runtime_pb2 as pb
from proto.errors import FlowControlViolation, LimitExceeded, LocalError, ProtocolViolation
from proto.limits import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_INFLIGHT_CHUNKS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    MAX_FRAME_BYTES,
    MAX_INFLIGHT_CHUNKS,
    MAX_PREFILL_CHUNK_TOKENS,
)

__all__ = ["negotiate", "CreditWindow", "CreditLedger"]


def _strictest(a: int, b: int, default: int, cap: int) -> int:
    stated = [v for v in (a, b) if v > 0]
    return min(min(stated) if stated else default, cap)


def negotiate(proposed: pb.FlowControl, local: pb.FlowControl) -> pb.FlowControl:
    """Settle the flow-control bounds of a session: the strictest of both sides wins."""
    inflight = _strictest(proposed.max_inflight_chunks, local.max_inflight_chunks,
                          DEFAULT_MAX_INFLIGHT_CHUNKS, MAX_INFLIGHT_CHUNKS)
    return pb.FlowControl(
        max_inflight_chunks=inflight,
        credits_granted=_strictest(proposed.credits_granted, local.credits_granted,
                                   inflight, inflight),
        max_chunk_bytes=_strictest(proposed.max_chunk_bytes, local.max_chunk_bytes,
                                   DEFAULT_MAX_CHUNK_BYTES, MAX_FRAME_BYTES),
        max_prefill_chunk_tokens=_strictest(proposed.max_prefill_chunk_tokens,
                                            local.max_prefill_chunk_tokens,
                                            DEFAULT_PREFILL_CHUNK_TOKENS, MAX_PREFILL_CHUNK_TOKENS),
    )


def _settled(flow: pb.FlowControl) -> tuple[int, int]:
    if not 0 < flow.max_inflight_chunks <= MAX_INFLIGHT_CHUNKS:
        raise LocalError("flow control must be negotiated: max_inflight_chunks "
                         f"{flow.max_inflight_chunks} not in 1..{MAX_INFLIGHT_CHUNKS}")
    if flow.credits_granted > flow.max_inflight_chunks:
        raise LocalError("initial credits exceed max_inflight_chunks; use negotiate()")
    return flow.max_inflight_chunks, flow.credits_granted


class CreditWindow:
    """Sender side of one stream: may I send a chunk now?"""

    __slots__ = ("max_inflight", "max_chunk_bytes", "available", "inflight")

    def __init__(self, negotiated: pb.FlowControl) -> None:
        self.max_inflight, self.available = _settled(negotiated)
        self.max_chunk_bytes = negotiated.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES
        self.inflight = 0

    def consume(self, nbytes: int = 0) -> None:
        """Spend one credit for a chunk of ``nbytes`` serialized bytes about to be sent."""
        if self.available <= 0:
            raise LocalError("no flow-control credit: wait for a grant before sending")
        if nbytes > self.max_chunk_bytes:
            raise LocalError(f"chunk of {nbytes} bytes > negotiated {self.max_chunk_bytes}")
        self.available -= 1
        self.inflight += 1

    def on_ack(self) -> None:
        """The receiver answered one chunk (Ack or DecodeResult)."""
        if self.inflight <= 0:
            raise ProtocolViolation("acknowledgement for a chunk that was never sent")
        self.inflight -= 1

    def on_grant(self, n: int) -> None:
        """The receiver sent ``FlowControl{credits_granted: n}``."""
        if n < 0 or self.available + n > self.max_inflight:
            raise FlowControlViolation(f"grant of {n} credits would hold {self.available + n} "
                                       f"> max_inflight_chunks {self.max_inflight}")
        self.available += n


class CreditLedger:
    """Receiver side of one stream: was this chunk allowed, and how much to grant back?"""

    __slots__ = ("max_inflight", "max_chunk_bytes", "outstanding")

    def __init__(self, negotiated: pb.FlowControl) -> None:
        self.max_inflight, self.outstanding = _settled(negotiated)
        self.max_chunk_bytes = negotiated.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES

    def on_chunk(self, nbytes: int = 0) -> None:
        """A chunk arrived: it must be covered by a credit we granted."""
        if self.outstanding <= 0:
            raise FlowControlViolation("chunk sent without flow-control credit")
        if nbytes > self.max_chunk_bytes:
            raise LimitExceeded(f"chunk of {nbytes} bytes > negotiated {self.max_chunk_bytes}")
        self.outstanding -= 1

    def grant(self, queued: int = 0) -> int:
        """Credits to send back now, given ``queued`` chunks we still hold unprocessed."""
        if queued < 0 or queued > self.max_inflight:
            raise LocalError(f"queued must be in 0..{self.max_inflight}")
        n = max(0, self.max_inflight - self.outstanding - queued)
        self.outstanding += n
        return n
