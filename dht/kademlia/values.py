"""The values a node stores, serves and reads under /meshd/ keys (pure rules).

The same rules run in the product and in the simulation: the product's KadDHT
serves through py-libp2p's handler, whose validator and value store
(dht/validator.py: ``MeshdValidator``, ``MergingValueStore``) call the
functions here; a simulated node keeps a ``ValueStore``, which applies them
in the order the library's PUT_VALUE handler does. A read (``fetched``) runs
in DhtNode.fetch and in the simulation alike (dht/kademlia/ops.py).

* ``check_value``: strict check of an incoming value under its key (a peer
  key holds one record of that peer; an index key a record set of records
  that belong under it).
* ``lenient``: a stored value's live records (expired ones dropped; a value
  broken in any other way reads as empty: an honest store never accepted it).
* ``select``: which of several values under one key wins. ``/meshd/peer/``:
  the highest sequence, ties to the first -- so a replay is refused. Index
  keys: the last value carrying news (a record newer than any the others
  hold for its peer); with no news anywhere the first (stored) value stays.
* ``merged``: what is stored after a PUT wins: a peer key's value replaces
  the stored one; an index key's records merge into the stored set (one per
  peer, highest sequence, unexpired, bounded: dht/records.py).
* ``readable``: the stored value as served: expired records pruned, None
  when nothing live is left.
* ``decode`` / ``fetched``: a reader's view -- every value that decodes and
  belongs under the key, merged; a refused value is logged and skipped.

The library's handler, on PUT_VALUE: validate the value (``check_value``);
read the stored value (``readable``); when there is one and ``select``
prefers it, refuse (the stream is reset); else store ``merged``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import cast

from dht import keys as K
from dht.errors import RecordRejected
from dht.expert_records import ExpertRecord, parse_expert_set_lenient, validate_expert_set
from dht.records import (
    CapabilityRecord,
    RecordCache,
    encode_record_set,
    merge_records,
    news,
    parse_record_set_lenient,
    validate_capability,
    validate_record_set,
)
from dht.relay_records import RelayRecord, parse_relay_set_lenient, validate_relay_set

log = logging.getLogger(__name__)

# Distinct /meshd/ keys one node stores. A swarm has one peer key per node and
# a model key plus a few span keys per served model; 8192 is far above a home
# swarm and bounds what minted identities can make us hold (each value is
# itself bounded by MAX_INDEX_RECORDS x MAX_RECORD_BYTES).
MAX_STORED_KEYS = 8192


def check_value(key: str, value: bytes, now_ms: int, cache: RecordCache | None = None
                ) -> list[CapabilityRecord] | list[RelayRecord] | list[ExpertRecord]:
    """Strict check of a /meshd/ value under ``key``; returns its records (of the key's kind)."""
    try:
        parsed = K.parse_key(key)
    except ValueError as exc:
        raise RecordRejected("key_mismatch", str(exc)) from exc
    if parsed.kind == "peer":
        rec = validate_capability(value, now_ms, cache)
        if rec.peer_id != parsed.subject:
            raise RecordRejected("key_mismatch", "record of another peer under a peer key")
        return [rec]
    if parsed.kind == "relays":
        return validate_relay_set(value, now_ms)
    if parsed.kind == "experts":
        experts = validate_expert_set(value, now_ms)
        if any(r.model_artifact_digest != parsed.subject for r in experts):
            raise RecordRejected("key_mismatch", "expert record of another model under this index key")
        return experts
    records = validate_record_set(value, now_ms, cache)
    if not records:
        raise RecordRejected("malformed", "an empty record set")
    for rec in records:
        if rec.model_artifact_digest != parsed.subject:
            raise RecordRejected("key_mismatch", "record of another model under this index key")
        if parsed.kind == "span" and not rec.withdrawn and rec.span != parsed.span:
            raise RecordRejected("key_mismatch", "record of another span under this span key")
    return records


def lenient(parsed: K.ParsedKey, value: bytes, now_ms: int,
            cache: RecordCache | None = None) -> list[CapabilityRecord]:
    """A stored value's live records; [] for a value broken in any way but expiry."""
    try:
        if parsed.kind == "peer":
            return [validate_capability(value, now_ms, cache)]
        if parsed.kind == "relays":
            return parse_relay_set_lenient(value, now_ms)  # type: ignore[return-value]
        if parsed.kind == "experts":
            return parse_expert_set_lenient(value, now_ms)  # type: ignore[return-value]
        return parse_record_set_lenient(value, now_ms, cache)
    except RecordRejected:
        return []


def select(key: str, values: list[bytes], now_ms: int, cache: RecordCache | None = None) -> int:
    """The index of the winning value under ``key`` (see the module docstring)."""
    if not values:
        raise ValueError("select from no values")
    parsed = K.parse_key(key)
    return select_decoded(parsed, [lenient(parsed, v, now_ms, cache) for v in values])


def select_decoded(parsed: K.ParsedKey, decoded: list[list[CapabilityRecord]]) -> int:
    """``select`` over the values' live records (``lenient`` of each)."""
    if parsed.kind == "peer":
        seqs = [max((r.sequence for r in recs), default=-1) for recs in decoded]
        return seqs.index(max(seqs))
    winner = 0
    for i, recs in enumerate(decoded):
        others = [r for j, rs in enumerate(decoded) if j != i for r in rs]
        if news(recs, others) > 0:
            winner = i
    return winner


def merged(parsed: K.ParsedKey, stored: bytes | None, incoming: bytes, now_ms: int,
           cache: RecordCache | None = None) -> bytes | None:
    """The value to store once ``incoming`` won over ``stored``; None when nothing live is left."""
    current = lenient(parsed, stored, now_ms, cache) if stored is not None and parsed.kind != "peer" else []
    out = merged_decoded(parsed, current, incoming, lenient(parsed, incoming, now_ms, cache), now_ms)
    return None if out is None else out[0]


def merged_decoded(parsed: K.ParsedKey, current: list[CapabilityRecord], incoming: bytes,
                   arriving: list[CapabilityRecord], now_ms: int) -> tuple[bytes, list[CapabilityRecord]] | None:
    """``merged`` over the stored value's live records and the incoming value's (and its bytes):
    (the value to store, its records), or None."""
    if parsed.kind == "peer":
        return incoming, arriving
    records = merge_records(current, arriving, now_ms)
    return (encode_record_set(records), records) if records else None


def readable(parsed: K.ParsedKey, stored: bytes, now_ms: int, cache: RecordCache | None = None) -> bytes | None:
    """``stored`` as served: an index value re-encoded without its expired records; None when empty."""
    records = lenient(parsed, stored, now_ms, cache)
    if not records:
        return None
    return stored if parsed.kind == "peer" else encode_record_set(records)


def decode(parsed: K.ParsedKey, value: bytes, now_ms: int, cache: RecordCache | None = None) -> list[CapabilityRecord]:
    """A reader's decoding of one answer's value: its live records, each under the right key;
    RecordRejected for anything else."""
    if parsed.kind == "relays":
        # fetch() reads every key kind; fetch_relays/fetch_experts name what theirs return.
        return parse_relay_set_lenient(value, now_ms)  # type: ignore[return-value]  # see above
    if parsed.kind == "experts":
        experts = parse_expert_set_lenient(value, now_ms)
        if any(r.model_artifact_digest != parsed.subject for r in experts):
            raise RecordRejected("key_mismatch", "expert record of another model")
        return experts  # type: ignore[return-value]  # see above
    if parsed.kind == "peer":
        rec = validate_capability(value, now_ms, cache)
        if rec.peer_id != parsed.subject:
            raise RecordRejected("key_mismatch", "record of another peer")
        return [rec]
    recs = parse_record_set_lenient(value, now_ms, cache)
    for rec in recs:
        if rec.model_artifact_digest != parsed.subject:
            raise RecordRejected("key_mismatch", "record of another model")
        if parsed.kind == "span" and not rec.withdrawn and rec.span != parsed.span:
            raise RecordRejected("key_mismatch", "record of another span")
    return recs


def fetched(key: str, values: Iterable[bytes], now_ms: int, cache: RecordCache | None = None) -> list[CapabilityRecord]:
    """Every valid, unexpired record under ``key`` among ``values`` (ours and the peers'), merged."""
    parsed = K.parse_key(key)
    out: list[CapabilityRecord] = []
    for value in dict.fromkeys(values):      # peers holding the same set: decoded and merged once
        try:
            recs = decode(parsed, value, now_ms, cache)
        except RecordRejected as exc:
            log.info("refused a value for %s from the DHT: %s", key, exc)
            continue
        out = merge_records(out, recs, now_ms)
    return out


def _parse(key: bytes) -> K.ParsedKey | None:
    try:
        return K.parse_key(key.decode())
    except (UnicodeDecodeError, ValueError):
        return None


class ValueStore:
    """A simulated node's stored values: the library's PUT_VALUE handler around the rules above.

    State: key bytes -> stored value bytes (at most MAX_STORED_KEYS keys), owned by one node;
    ``clock()`` gives wall-clock ms. Each stored value's live records are kept beside it
    with the moment the first of them expires: until then ``lenient`` of that value would
    return the same records, so they are not decoded again (a pure function's memo)."""

    def __init__(self, clock: Callable[[], int], cache: RecordCache | None = None,
                 max_keys: int = MAX_STORED_KEYS) -> None:
        self.clock, self.cache, self.max_keys = clock, cache, max_keys
        self.values: dict[bytes, bytes] = {}
        self._live: dict[bytes, tuple[list[CapabilityRecord], int]] = {}   # key -> (records, first expiry)
        self._keys: dict[bytes, K.ParsedKey] = {}                          # stored keys, parsed

    def _records(self, key: bytes, parsed: K.ParsedKey, now: int) -> list[CapabilityRecord]:
        """The stored value's live records, pruned in place when some expired (forgotten once none is left)."""
        memo = self._live.get(key)
        if memo is not None and now < memo[1]:
            return memo[0]
        records = lenient(parsed, self.values[key], now, self.cache)
        if not records:
            self._forget(key)
            return []
        if parsed.kind != "peer":
            self.values[key] = encode_record_set(records)
        self._live[key] = (records, min(r.expires_at_ms for r in records))
        return records

    def get(self, key: bytes) -> bytes | None:
        """The value served for ``key`` (pruned of expired records; forgotten once empty)."""
        if key not in self.values:
            return None
        return self.values[key] if self._records(key, self._keys[key], self.clock()) else None

    def put(self, key: bytes, value: bytes) -> bool:
        """A remote PUT_VALUE: True when stored (acknowledged), False when the stored value wins
        (refused); RecordRejected for a value that fails validation (refused too)."""
        return self._put(key.decode(), key, value, refuse=False)

    def store_locally(self, key: str, value: bytes) -> None:
        """Our own value: validated like a remote PUT; a value the stored one beats is refused."""
        self._put(key, key.encode(), value, refuse=True)

    def _put(self, name: str, key: bytes, value: bytes, *, refuse: bool) -> bool:
        now = self.clock()
        # every kind's records merge alike (peer, sequence, expiry), as ``lenient`` reads them
        arriving = cast("list[CapabilityRecord]", check_value(name, value, now, self.cache))
        parsed = self._keys.get(key) or K.parse_key(name)
        current = self._records(key, parsed, now) if key in self.values else []
        if current and select_decoded(parsed, [current, arriving]) == 0:
            if refuse:
                raise RecordRejected("replayed", "the stored value is newer")
            return False
        out = merged_decoded(parsed, current, value, arriving, now)
        if out is None:
            self._forget(key)
            return True
        if key not in self.values and len(self.values) >= self.max_keys:
            raise RecordRejected("too_large", f"this node already stores {self.max_keys} keys")
        self.values[key], records = out
        self._live[key] = (records, min(r.expires_at_ms for r in records))
        self._keys[key] = parsed
        return True

    def _forget(self, key: bytes) -> None:
        self.values.pop(key, None)
        self._live.pop(key, None)
        self._keys.pop(key, None)
