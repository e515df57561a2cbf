"""Signed records for the DHT and the tracker: Ed25519 over a domain-separated message.

    signed message = RECORD_DOMAIN || uint8(kind) || payload
    SignedRecord   = {kind, payload, signature (64 bytes), public_key (raw 32 bytes)}

``sign_record`` builds one (LocalError on bad arguments). Decoding a peer's
record: ``parse_signed_record`` (bounded parse, known kind) ->
``verify_record_signature`` (PayloadCorrupt on a bad key/signature) ->
``parse_capability`` / ``parse_directive`` (payload of the right kind and
schema version). Binding the key to the peer id, expiry, sequence and replay
rules belong to the daemon (dht/); this module knows no clock.
"""
from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from google.protobuf.message import DecodeError

from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, LocalError, PayloadCorrupt, ProtocolViolation
from proto.frames import check_schema_version
from proto.limits import DEFAULT_LIMITS, Limits

__all__ = ["RECORD_DOMAIN", "signed_message", "sign_record", "verify_record_signature",
           "parse_signed_record", "parse_capability", "parse_directive", "public_key_bytes"]

RECORD_DOMAIN = b"meshd-record-v1\x00"
_KINDS = frozenset({pb.RECORD_KIND_CAPABILITY, pb.RECORD_KIND_DIRECTIVE, pb.RECORD_KIND_RELAY,
                    pb.RECORD_KIND_EXPERTS, pb.RECORD_KIND_EVIDENCE})
ED25519_KEY_BYTES = 32
ED25519_SIGNATURE_BYTES = 64


def signed_message(kind: int, payload: bytes) -> bytes:
    """The exact bytes an Ed25519 record signature covers."""
    return RECORD_DOMAIN + bytes([kind]) + payload


def public_key_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """Raw 32-byte public key of a private or public Ed25519 key."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign_record(kind: pb.RecordKind, payload: bytes, key: Ed25519PrivateKey) -> pb.SignedRecord:
    """Sign ``payload`` (a serialized CapabilityPayload or RebalanceDirective)."""
    if kind not in _KINDS:
        raise LocalError(f"record kind must be CAPABILITY, DIRECTIVE, RELAY, EXPERTS or EVIDENCE, got {kind}")
    if not isinstance(payload, bytes):
        raise LocalError("record payload must be bytes (a serialized message)")
    if len(payload) > DEFAULT_LIMITS.max_record_bytes:
        raise LocalError(f"record payload of {len(payload)} bytes "
                         f"> {DEFAULT_LIMITS.max_record_bytes}")
    if not isinstance(key, Ed25519PrivateKey):
        raise LocalError("records are signed with an Ed25519PrivateKey")
    return pb.SignedRecord(kind=kind, payload=payload,
                           signature=key.sign(signed_message(kind, payload)),
                           public_key=public_key_bytes(key))


def verify_record_signature(rec: pb.SignedRecord) -> None:
    """PayloadCorrupt unless ``rec.signature`` is ``rec.public_key``'s over the record."""
    if rec.kind not in _KINDS:
        raise ProtocolViolation(f"unknown record kind {rec.kind}")
    if len(rec.public_key) != ED25519_KEY_BYTES:
        raise PayloadCorrupt(f"record public key must be {ED25519_KEY_BYTES} bytes")
    if len(rec.signature) != ED25519_SIGNATURE_BYTES:
        raise PayloadCorrupt(f"record signature must be {ED25519_SIGNATURE_BYTES} bytes")
    try:
        Ed25519PublicKey.from_public_bytes(rec.public_key).verify(
            rec.signature, signed_message(rec.kind, rec.payload))
    except (InvalidSignature, ValueError) as exc:
        raise PayloadCorrupt("record signature does not verify") from exc


def _parse(message, data, limit: int, what: str):
    if len(data) > limit:
        raise LimitExceeded(f"{what} of {len(data)} bytes > {limit}")
    try:
        message.ParseFromString(data)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise PayloadCorrupt(f"{what} does not parse: {exc}") from exc
    return message


def parse_signed_record(data: bytes, limits: Limits = DEFAULT_LIMITS) -> pb.SignedRecord:
    """Bounded parse of a SignedRecord from the DHT; checks kind and field sizes."""
    # A record is its payload plus a key, a signature and a few tags.
    rec = _parse(pb.SignedRecord(), data, limits.max_record_bytes + 128, "signed record")
    if rec.kind not in _KINDS:
        raise ProtocolViolation(f"unknown record kind {rec.kind}")
    if len(rec.payload) > limits.max_record_bytes:
        raise LimitExceeded(f"record payload > {limits.max_record_bytes} bytes")
    return rec


def _payload(rec: pb.SignedRecord, kind: int, message, limits: Limits):
    if rec.kind != kind:
        raise ProtocolViolation(f"expected a {pb.RecordKind.Name(kind)} record, got kind {rec.kind}")
    msg = _parse(message, rec.payload, limits.max_record_bytes, pb.RecordKind.Name(kind))
    check_schema_version(msg.schema_version)
    return msg


def parse_capability(rec: pb.SignedRecord, limits: Limits = DEFAULT_LIMITS) -> pb.CapabilityPayload:
    """The CapabilityPayload inside a (verified) capability record."""
    return _payload(rec, pb.RECORD_KIND_CAPABILITY, pb.CapabilityPayload(), limits)


def parse_directive(rec: pb.SignedRecord, limits: Limits = DEFAULT_LIMITS) -> pb.RebalanceDirective:
    """The RebalanceDirective inside a (verified) directive record."""
    return _payload(rec, pb.RECORD_KIND_DIRECTIVE, pb.RebalanceDirective(), limits)
