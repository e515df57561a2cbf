"""The entry's check of each hop's step receipts (proto/receipts.py), as they arrive with the answers.

A hop that signs receipts sends its key's certificate in SessionAccepted and one
signed receipt with every chunk and decode answer (no extra round trip). The
hop link (hop_link.py) hands both here:

    certificate   signed by the node key of the peer the link dialled
                  (``binds(peer_id, node_public_key)``: the libp2p peer id is the
                  identity multihash of that key, dht/identity.py), not expired
    receipt       signed by the certified key; names this link's session, epoch,
                  [effective start, end), positions and peer; its input digest is
                  the digest of the rows (or token ids) the entry sent, and -- for a
                  hop that returns rows -- its output digest is the digest of the rows
                  it sent back. On a star route the entry feeds hop i+1 exactly the
                  rows hop i returned, so these checks chain the hops' digests: hop i's
                  output digest is hop i+1's input digest.

A tail's output digest covers its logits, which the entry does not see unless
it asked for them: it is kept (``HopLink.receipts``) for audits and evidence.

Any failed check is the hop's fault (PayloadCorrupt; the link turns it into a
HopFailure and the driver fails over). A hop that sends no receipts is
accepted unless ``required`` (peers of older builds sign nothing).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dht.identity import peer_id_from_public_key
from proto import shard_runtime_pb2 as pb
from proto.errors import PayloadCorrupt, ProtocolViolation
from proto.receipts import (
    Delegation,
    Receipt,
    SignedReceipt,
    chain_history,
    parse_delegation,
    parse_signed_receipt,
    rows_digest,
    verify_delegation,
    verify_receipt,
)


def peer_id_binds(peer_id: str, node_public_key: bytes) -> bool:
    """The libp2p binding: the peer id is the identity multihash of the node's Ed25519 key."""
    try:
        return peer_id_from_public_key(node_public_key) == peer_id
    except Exception:  # noqa: BLE001 - a key that makes no peer id binds to none
        return False


@dataclass(frozen=True, slots=True)
class ReceiptCheck:
    """How an entry checks receipts: the peer-id binding, the clock, whether they are required."""

    binds: Callable[[str, bytes], bool] = peer_id_binds
    now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000
    required: bool = False

    def delegation(self, peer_id: str, accepted: pb.SessionAccepted) -> Delegation | None:
        """The hop's certified receipt key from its SessionAccepted (None: it signs nothing)."""
        if not accepted.HasField("receipt_key"):
            if self.required:
                raise ProtocolViolation("the hop signs no step receipts and this entry requires them")
            return None
        d = parse_delegation(accepted.receipt_key)
        if not self.binds(peer_id, d.node_public_key):
            raise PayloadCorrupt("the receipt key is certified by a key that is not this peer's")
        verify_delegation(d, self.now_ms())
        return d

    def receipt(self, delegation: Delegation | None, data: bytes, *, peer_id: str, session_id: str, epoch: int,
                start: int, end: int, first: int, inputs: np.ndarray, output: np.ndarray | None,
                history: bytes) -> SignedReceipt | None:
        """The verified receipt of one answer (``output``: the rows it returned, None for a tail's
        token; ``history``: the session's input chain before this step); PayloadCorrupt or
        ProtocolViolation when it lies or is missing where one is due."""
        if delegation is None:
            if data:
                raise ProtocolViolation("a step receipt from a hop that certified no receipt key")
            return None
        if not data:
            raise ProtocolViolation("the hop certified a receipt key but sent no receipt for a step")
        signed = parse_signed_receipt(data)
        r: Receipt = verify_receipt(signed, delegation)
        want = (session_id, epoch, start, end, first, int(inputs.shape[0]))
        got = (r.session_id, r.epoch, r.start, r.end, r.first_position, r.count)
        if got != want:
            raise PayloadCorrupt(f"the step receipt names {got}, the step was {want}")
        # the signer names itself by the peer id the entry dialled or by its node key's own id
        # (a fixed route's hops are named by their endpoints)
        if r.peer_id != peer_id and not peer_id_binds(r.peer_id, delegation.node_public_key):
            raise PayloadCorrupt(f"the step receipt names peer {r.peer_id[:60]!r}, not the one that signed it")
        if r.input_sha256 != rows_digest(inputs):
            raise PayloadCorrupt("the step receipt's input digest is not the rows this entry sent")
        if r.history_sha256 != chain_history(history, r.input_sha256):
            raise PayloadCorrupt("the step receipt's input history is not the session's")
        if output is not None and r.output_sha256 != rows_digest(output):
            raise PayloadCorrupt("the step receipt's output digest is not the rows the hop sent back")
        return signed
