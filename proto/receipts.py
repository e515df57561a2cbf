"""Step receipts: a hop's signed statement of what went into one step and what came out.

Why: a signed capability record proves who a peer is, not what it computed.
A receipt binds a peer to the exact rows of one step, so that an entry which
recomputes the step on another replica (meshd/generate/audit.py) holds proof
of a lie -- and so that a third node can check that proof by recomputing it
too, instead of taking the accuser's word.

    Receipt          (session, epoch, [start, end) layers, first position, count,
                      sha256 of the input rows, sha256 of the output rows -- or of a
                      tail's token and logits --, the serving node's peer id, and the
                      chain of every input digest of the session so far: an output
                      depends on the whole KV history, so a receipt pins all of it)
    SignedReceipt    {body: serialized StepReceipt, signature: delegate key over
                      RECEIPT_DOMAIN || body}; the entry keeps the bytes it got, so
                      no canonical re-encoding is ever needed to verify
    KeyDelegation    {node public key, delegate public key, not after (unix ms),
                      node key's signature over DELEGATION_DOMAIN || delegate || not_after}

Who signs: the worker (a subprocess of the daemon), never with the node's own
key. The daemon makes a fresh Ed25519 key per worker run, certifies its public
half with the node key (``certify``: short-lived, DELEGATION_TTL_MS) and hands
the private half to the worker in a 0600 file in the worker's private run
directory (the same directory as its ready file), which the worker reads and
unlinks at start. Not on the command line (world-readable in /proc), not in
the environment (inherited by every child, readable in /proc/PID/environ by
the same user and kept for the process's life); a file of the run's owner,
removed once read, is the smallest exposure the existing spawn already has
a channel for. A leaked delegate key lets its holder sign receipts for one
node for one run, not impersonate the node in the DHT. The worker sends the
certificate once per session (``SessionAccepted.receipt_key``) and a
signed receipt with every answer (``DecodeResult.receipt``,
``ActivationChunk.receipt``): no extra round trip, ~170 bytes a step.

Hashes: ``rows_digest`` covers dtype, shape and the little-endian C-order
bytes of an array, so it is the same on both ends of a lossless wire; the
entry checks hop i's output digest against hop i+1's input digest where it
sees both. ``tail_digest`` covers a tail's drawn token (or -1: no draw) and
the digest of its logits rows.

Binding a node public key to a peer id belongs to dht/ (identity
multihash); this module knows no clock (callers pass ``now_ms``) and no
network. Every parse is bounded (MAX_RECEIPT_BYTES, MAX_DELEGATION_BYTES)
and raises only typed ProtocolErrors for a peer's bad bytes; LocalError for
our own bad arguments.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from google.protobuf.message import DecodeError

from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolViolation
from proto.records import ED25519_KEY_BYTES, ED25519_SIGNATURE_BYTES, public_key_bytes

__all__ = ["HISTORY_START", "chain_history",
           "Receipt", "Delegation", "sign_receipt", "parse_signed_receipt", "verify_receipt", "certify",
           "parse_delegation", "verify_delegation", "rows_digest", "tail_digest", "RECEIPT_DOMAIN",
           "DELEGATION_DOMAIN", "DIGEST_BYTES", "MAX_RECEIPT_BYTES", "MAX_DELEGATION_BYTES", "ReceiptSigner"]

# Domain separation: a receipt signature can never pass for a record or a delegation.
RECEIPT_DOMAIN = b"meshd-receipt-v1\x00"
DELEGATION_DOMAIN = b"meshd-receipt-key-v1\x00"
DIGEST_BYTES = 32                      # sha256
# Session ids are uuid hex (32 chars, driver.py); 128 leaves room for derived audit ids.
MAX_SESSION_ID_LEN = 128
# libp2p peer ids in base58 are ~52 chars; in-memory tests use short names.
MAX_PEER_ID_LEN = 128
# Layers and positions: a model has at most 2**16 layers here and a session at most
# proto's 2**32 positions; bounds keep a receipt's numbers meaningful.
MAX_LAYERS = 1 << 16
MAX_POSITION = 1 << 32
# A serialized StepReceipt is ~150 bytes at the bounds above; its SignedReceipt
# ~230. 1 KiB bounds a peer's receipt before protobuf looks at it.
MAX_RECEIPT_BYTES = 1024
# A KeyDelegation is 2 keys + a signature + a varint: ~140 bytes.
MAX_DELEGATION_BYTES = 512
# How long a worker's receipt key is certified for: a run is re-certified by the
# daemon on restart; a day bounds what a key leaked from a dead run is worth.
DELEGATION_TTL_MS = 24 * 3600 * 1000
# The worker's key file (see the module doc): this tag, the 32-byte seed, then the certificate.
KEY_FILE_MAGIC = b"meshd-receipt-key-v1\n"


def rows_digest(rows: np.ndarray) -> bytes:
    """sha256 of an array's dtype, shape and little-endian C-order bytes (see the module doc)."""
    a = np.asarray(rows)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.ascontiguousarray(a)
    h = hashlib.sha256()
    h.update(a.dtype.str.encode() + b"|" + ",".join(map(str, a.shape)).encode() + b"|")
    h.update(a.tobytes())
    return h.digest()


# The history chain of a session before its first step.
HISTORY_START = bytes(DIGEST_BYTES)


def chain_history(previous: bytes, input_sha256: bytes) -> bytes:
    """The session's input history after one more step: sha256(previous || this step's input digest)."""
    return hashlib.sha256(b"history|" + previous + input_sha256).digest()


def tail_digest(token: int | None, logits: np.ndarray | None) -> bytes:
    """sha256 of a tail's answer: its drawn token (None: no draw) and its logits rows' digest."""
    t = -1 if token is None else int(token)
    body = t.to_bytes(8, "little", signed=True) + (rows_digest(logits) if logits is not None else b"")
    return hashlib.sha256(b"tail|" + body).digest()


@dataclass(frozen=True, slots=True)
class Receipt:
    """One step a hop served (validated when built: a Receipt that exists is a valid one)."""

    session_id: str
    epoch: int
    start: int                 # the effective start layer the step ran from
    end: int
    first_position: int
    count: int
    input_sha256: bytes
    output_sha256: bytes
    peer_id: str
    history_sha256: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not 0 < len(self.session_id) <= MAX_SESSION_ID_LEN:
            raise ProtocolViolation(f"a receipt's session id must have 1..{MAX_SESSION_ID_LEN} characters")
        if not isinstance(self.peer_id, str) or not 0 < len(self.peer_id) <= MAX_PEER_ID_LEN:
            raise ProtocolViolation(f"a receipt's peer id must have 1..{MAX_PEER_ID_LEN} characters")
        if not 0 <= self.epoch < 1 << 63:
            raise ProtocolViolation("a receipt's epoch is out of range")
        if not 0 <= self.start < self.end <= MAX_LAYERS:
            raise ProtocolViolation(f"a receipt's layers must satisfy 0 <= start < end <= {MAX_LAYERS}")
        if not (0 <= self.first_position < MAX_POSITION and 0 < self.count <= MAX_POSITION - self.first_position):
            raise ProtocolViolation("a receipt's positions are out of range")
        for name in ("input_sha256", "output_sha256", "history_sha256"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != DIGEST_BYTES:
                raise ProtocolViolation(f"a receipt's {name} must be {DIGEST_BYTES} bytes")

    @property
    def positions(self) -> range:
        return range(self.first_position, self.first_position + self.count)

    def to_pb(self) -> pb.StepReceipt:
        return pb.StepReceipt(route_session_id=self.session_id, route_epoch=self.epoch, start_layer=self.start,
                              end_layer=self.end, first_position=self.first_position, count=self.count,
                              input_sha256=self.input_sha256, output_sha256=self.output_sha256,
                              peer_id=self.peer_id, history_sha256=self.history_sha256)

    @classmethod
    def from_pb(cls, m: pb.StepReceipt) -> Receipt:
        return cls(m.route_session_id, int(m.route_epoch), int(m.start_layer), int(m.end_layer),
                   int(m.first_position), int(m.count), bytes(m.input_sha256), bytes(m.output_sha256), m.peer_id,
                   bytes(m.history_sha256))


@dataclass(frozen=True, slots=True)
class Delegation:
    """A node key's certificate for a worker's receipt key (checked with ``verify_delegation``)."""

    node_public_key: bytes
    delegate_public_key: bytes
    not_after_ms: int
    signature: bytes

    def __post_init__(self) -> None:
        for name in ("node_public_key", "delegate_public_key"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != ED25519_KEY_BYTES:
                raise PayloadCorrupt(f"a receipt key delegation's {name} must be {ED25519_KEY_BYTES} bytes")
        if not isinstance(self.signature, bytes) or len(self.signature) != ED25519_SIGNATURE_BYTES:
            raise PayloadCorrupt(f"a receipt key delegation's signature must be {ED25519_SIGNATURE_BYTES} bytes")
        if not 0 <= self.not_after_ms < 1 << 63:
            raise ProtocolViolation("a receipt key delegation's expiry is out of range")

    def message(self) -> bytes:
        return _delegation_message(self.delegate_public_key, self.not_after_ms)

    def to_pb(self) -> pb.KeyDelegation:
        return pb.KeyDelegation(node_public_key=self.node_public_key, delegate_public_key=self.delegate_public_key,
                                not_after_unix_ms=self.not_after_ms, signature=self.signature)

    @classmethod
    def from_pb(cls, m: pb.KeyDelegation) -> Delegation:
        return cls(bytes(m.node_public_key), bytes(m.delegate_public_key), int(m.not_after_unix_ms),
                   bytes(m.signature))


def _delegation_message(delegate_public_key: bytes, not_after_ms: int) -> bytes:
    return DELEGATION_DOMAIN + delegate_public_key + not_after_ms.to_bytes(8, "big")


def certify(node_key: Ed25519PrivateKey, delegate_public_key: bytes, not_after_ms: int) -> Delegation:
    """The node key's certificate for ``delegate_public_key`` until ``not_after_ms``."""
    if not isinstance(node_key, Ed25519PrivateKey):
        raise LocalError("a receipt key is certified with the node's Ed25519PrivateKey")
    if not isinstance(delegate_public_key, bytes) or len(delegate_public_key) != ED25519_KEY_BYTES:
        raise LocalError(f"a delegate public key has {ED25519_KEY_BYTES} bytes")
    if not 0 <= not_after_ms < 1 << 63:
        raise LocalError("not_after_ms out of range")
    sig = node_key.sign(_delegation_message(delegate_public_key, not_after_ms))
    return Delegation(public_key_bytes(node_key), delegate_public_key, not_after_ms, sig)


def parse_delegation(data: bytes | pb.KeyDelegation) -> Delegation:
    """A peer's KeyDelegation (bytes or the message): bounded, shape-checked, not yet verified."""
    if isinstance(data, pb.KeyDelegation):
        if data.ByteSize() > MAX_DELEGATION_BYTES:
            raise LimitExceeded(f"a receipt key delegation over {MAX_DELEGATION_BYTES} bytes")
        return Delegation.from_pb(data)
    return Delegation.from_pb(_parse(pb.KeyDelegation(), data, MAX_DELEGATION_BYTES, "receipt key delegation"))


def verify_delegation(d: Delegation, now_ms: int, node_public_key: bytes | None = None) -> None:
    """PayloadCorrupt unless the node key signed ``d`` (and is ``node_public_key`` when given);
    ProtocolViolation when it expired at ``now_ms``."""
    if node_public_key is not None and d.node_public_key != node_public_key:
        raise PayloadCorrupt("the receipt key is certified by another node's key")
    try:
        Ed25519PublicKey.from_public_bytes(d.node_public_key).verify(d.signature, d.message())
    except (InvalidSignature, ValueError) as exc:
        raise PayloadCorrupt("the receipt key's certificate does not verify") from exc
    if now_ms > d.not_after_ms:
        raise ProtocolViolation("the receipt key's certificate has expired")


def _parse(message, data: bytes, limit: int, what: str):
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadCorrupt(f"a {what} must be bytes")
    if len(data) > limit:
        raise LimitExceeded(f"a {what} of {len(data)} bytes > {limit}")
    try:
        message.ParseFromString(bytes(data))
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise PayloadCorrupt(f"a {what} does not parse") from exc
    return message


@dataclass(frozen=True, slots=True)
class SignedReceipt:
    """A receipt as it arrived: its body bytes, the signature over them, and the parsed receipt."""

    body: bytes
    signature: bytes
    receipt: Receipt

    def to_bytes(self) -> bytes:
        return pb.SignedReceipt(body=self.body, signature=self.signature).SerializeToString()


def sign_receipt(receipt: Receipt, key: Ed25519PrivateKey) -> bytes:
    """The serialized SignedReceipt of ``receipt`` under the worker's delegate ``key``."""
    if not isinstance(key, Ed25519PrivateKey):
        raise LocalError("receipts are signed with an Ed25519PrivateKey")
    body = receipt.to_pb().SerializeToString()
    return pb.SignedReceipt(body=body, signature=key.sign(RECEIPT_DOMAIN + body)).SerializeToString()


def parse_signed_receipt(data: bytes) -> SignedReceipt:
    """A peer's SignedReceipt bytes: bounded parse, receipt fields validated (not the signature)."""
    outer = _parse(pb.SignedReceipt(), data, MAX_RECEIPT_BYTES, "signed receipt")
    if len(outer.signature) != ED25519_SIGNATURE_BYTES:
        raise PayloadCorrupt(f"a receipt signature must be {ED25519_SIGNATURE_BYTES} bytes")
    inner = _parse(pb.StepReceipt(), outer.body, MAX_RECEIPT_BYTES, "step receipt")
    return SignedReceipt(bytes(outer.body), bytes(outer.signature), Receipt.from_pb(inner))


def verify_receipt(signed: SignedReceipt, delegation: Delegation) -> Receipt:
    """The receipt, once its signature verifies under the delegated key (PayloadCorrupt if not).
    The delegation itself is checked with ``verify_delegation``."""
    try:
        Ed25519PublicKey.from_public_bytes(delegation.delegate_public_key).verify(
            signed.signature, RECEIPT_DOMAIN + signed.body)
    except (InvalidSignature, ValueError) as exc:
        raise PayloadCorrupt("the step receipt's signature does not verify") from exc
    return signed.receipt


class ReceiptSigner:
    """A worker's receipt key and its certificate: what signs each step it serves."""

    __slots__ = ("peer_id", "_key", "delegation")

    def __init__(self, peer_id: str, key: Ed25519PrivateKey, delegation: Delegation) -> None:
        if public_key_bytes(key) != delegation.delegate_public_key:
            raise LocalError("the receipt key is not the one its certificate names")
        self.peer_id, self._key, self.delegation = peer_id, key, delegation

    @classmethod
    def fresh(cls, peer_id: str, node_key: Ed25519PrivateKey, now_ms: int,
              ttl_ms: int = DELEGATION_TTL_MS) -> ReceiptSigner:
        """A new per-run key certified by ``node_key`` (the daemon's side; tests)."""
        key = Ed25519PrivateKey.generate()
        return cls(peer_id, key, certify(node_key, public_key_bytes(key), now_ms + ttl_ms))

    def sign(self, session_id: str, epoch: int, start: int, end: int, first_position: int, count: int,
             input_sha256: bytes, output_sha256: bytes, history_sha256: bytes) -> bytes:
        return sign_receipt(Receipt(session_id, epoch, start, end, first_position, count, input_sha256,
                                    output_sha256, self.peer_id, history_sha256), self._key)

    def key_file_bytes(self) -> bytes:
        """What the daemon writes for its worker: KEY_FILE_MAGIC, the 32-byte seed, the certificate."""
        seed = self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return KEY_FILE_MAGIC + seed + self.delegation.to_pb().SerializeToString()

    @classmethod
    def from_key_file(cls, data: bytes, peer_id_of: Callable[[bytes], str]) -> ReceiptSigner:
        """The worker's side of ``key_file_bytes`` (``peer_id_of``: the node key's peer id); a
        PayloadCorrupt for anything else."""
        head = len(KEY_FILE_MAGIC) + ED25519_KEY_BYTES
        if len(data) > head + MAX_DELEGATION_BYTES or not data.startswith(KEY_FILE_MAGIC) or len(data) <= head:
            raise PayloadCorrupt("not a receipt key file")
        key = Ed25519PrivateKey.from_private_bytes(data[len(KEY_FILE_MAGIC):head])
        delegation = parse_delegation(data[head:])
        if public_key_bytes(key) != delegation.delegate_public_key:
            raise PayloadCorrupt("the receipt key file's key is not the one its certificate names")
        return cls(peer_id_of(delegation.node_public_key), key, delegation)
