"""Signed relay records: a public relay announces itself in the DHT (sans-I/O).

A relay record is a ``pb.SignedRecord`` (kind RELAY) whose payload is a
``pb.RelayPayload``: the relay's peer id and public multiaddrs, with an issue
time, an expiry and a sequence. ``meshd relay`` signs one and republishes it
(relay/announce.py); every relay's record lives in ONE index key,
``/meshd/relays/v1`` (dht/keys.py), as a record set encoded exactly like a
capability index (dht/records.py: at most one record per relay, merged by
sequence, expired ones dropped). Nodes behind NAT read that key to find
relays to reserve on (meshd/reach/relaying.py).

Rules (checked in this order by ``validate_relay``), the same as for
capability records:

1. size: at most ``MAX_RECORD_BYTES`` serialized, before parsing;
2. the wrapper parses and its kind is RELAY;
3. the Ed25519 signature over the domain-separated payload verifies;
4. the payload parses and its schema version is one we know;
5. the public key hashes to the peer id named inside the payload;
6. 1..MAX_RELAY_ADDRS addresses, each a parseable multiaddr of at most
   MAX_ADDR_CHARS ending in ``/p2p/<that peer id>`` and not itself relayed;
7. not future-dated beyond ``MAX_CLOCK_SKEW_MS``, lifetime at most
   ``MAX_RECORD_LIFETIME_MS``, not expired.

Replays: a record with an equal or lower sequence never replaces a stored one
(``dht.records.merge_records`` / ``news`` work on these records too: they
have the same ``peer_id``, ``sequence``, ``expires_at_ms`` and ``withdrawn``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dht.errors import RecordRejected
from dht.records import (
    MAX_ADDR_CHARS,
    MAX_RECORD_LIFETIME_MS,
    check_lifetime,
    decode_record_set,
    open_signed,
    sign_payload,
)
from proto import shard_runtime_pb2 as pb

__all__ = ["RelayRecord", "sign_relay", "validate_relay", "validate_relay_set", "parse_relay_set_lenient",
           "MAX_RELAY_ADDRS"]

# A relay listens on a few interfaces (IPv4, IPv6, maybe a second port); 8
# addresses cover that and keep 128 relay records well under one DHT value.
MAX_RELAY_ADDRS = 8
_CIRCUIT = "/p2p-circuit"


@dataclass(frozen=True, slots=True)
class RelayRecord:
    """A relay record that passed ``validate_relay``: exists only when valid."""

    raw: bytes = field(repr=False)
    peer_id: str
    sequence: int
    addrs: tuple[str, ...]
    issued_at_ms: int
    expires_at_ms: int

    # Relay records are never withdrawn: a stopped relay's record simply expires.
    withdrawn: bool = False

    def expired(self, now_ms: int) -> bool:
        return self.expires_at_ms <= now_ms


def _addr_problem(addr: str, peer_id: str) -> str | None:
    import multiaddr

    if not isinstance(addr, str) or not addr or len(addr) > MAX_ADDR_CHARS:
        return "an address is empty or too long"
    if _CIRCUIT in addr:
        return "a relay's own address cannot be relayed"
    if not addr.endswith(f"/p2p/{peer_id}"):
        return "every address must end in /p2p/<the relay's peer id>"
    try:
        multiaddr.Multiaddr(addr)
    except Exception:  # noqa: BLE001 - the multiaddr library raises several unrelated types
        return "an address does not parse as a multiaddr"
    return None


def sign_relay(addrs: Sequence[str], key, *, peer_id: str, sequence: int, now_ms: int, ttl_ms: int) -> bytes:
    """Sign a relay record for ``addrs`` (each ending in /p2p/<peer_id>); returns record bytes."""
    addrs = tuple(addrs)
    if not 1 <= len(addrs) <= MAX_RELAY_ADDRS:
        raise ValueError(f"a relay record carries 1..{MAX_RELAY_ADDRS} addresses, not {len(addrs)}")
    for addr in addrs:
        problem = _addr_problem(addr, peer_id)
        if problem:
            raise ValueError(f"{addr!r}: {problem}")
    if not 0 < ttl_ms <= MAX_RECORD_LIFETIME_MS:
        raise ValueError(f"ttl_ms must be within (0, {MAX_RECORD_LIFETIME_MS}]")
    payload = pb.RelayPayload(schema_version=pb.SCHEMA_VERSION_1, peer_id=peer_id, addrs=list(addrs),
                              issued_at_unix_ms=now_ms, expires_at_unix_ms=now_ms + ttl_ms, sequence=sequence)
    return sign_payload(pb.RECORD_KIND_RELAY, payload, key)


def validate_relay(data: bytes, now_ms: int) -> RelayRecord:
    """Check every rule in the module docstring; raise RecordRejected(reason) on the first broken."""
    payload = open_signed(data, pb.RECORD_KIND_RELAY, pb.RelayPayload)
    if not 1 <= len(payload.addrs) <= MAX_RELAY_ADDRS:
        raise RecordRejected("malformed", f"a relay record carries 1..{MAX_RELAY_ADDRS} addresses")
    for addr in payload.addrs:
        problem = _addr_problem(addr, payload.peer_id)
        if problem:
            raise RecordRejected("malformed", problem)
    issued, expires = check_lifetime(payload, now_ms)
    return RelayRecord(raw=data, peer_id=payload.peer_id, sequence=payload.sequence, addrs=tuple(payload.addrs),
                       issued_at_ms=issued, expires_at_ms=expires)


def validate_relay_set(data: bytes, now_ms: int) -> list[RelayRecord]:
    """Strict: every record valid and at most one per relay, else RecordRejected."""
    records = [validate_relay(raw, now_ms) for raw in decode_record_set(data)]
    peers = [r.peer_id for r in records]
    if len(set(peers)) != len(peers):
        raise RecordRejected("malformed", "two records of one relay in a set")
    if not records:
        raise RecordRejected("malformed", "an empty record set")
    return records


def parse_relay_set_lenient(data: bytes, now_ms: int) -> list[RelayRecord]:
    """For stored sets: drop records that expired since; anything else broken refuses the set."""
    out = []
    for raw in decode_record_set(data):
        try:
            out.append(validate_relay(raw, now_ms))
        except RecordRejected as exc:
            if exc.reason != "expired":
                raise
    return out
