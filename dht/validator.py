"""Glue between the pure record rules (dht/records.py) and py-libp2p's KadDHT.

``MeshdValidator`` is registered for the ``meshd`` namespace of a
``NamespacedValidator`` with ``strict_validation=True``: any other key is
refused by the library, any /meshd/ value is checked here with an injected
wall clock (``clock() -> unix ms``).

py-libp2p stores a PUT_VALUE only when ``validate`` passes and
``select([stored, incoming])`` returns 1; it then calls
``value_store.put_record``. The select rules:

* ``/meshd/peer/<id>``: the highest sequence wins, ties go to the first
  value -- so a replay (equal or lower sequence) is refused.
* ``/meshd/relays/v1`` holds relay records (dht/relay_records.py) and is
  an index key like the others: same set encoding, same merge rules; so is
  ``/meshd/experts/<digest>`` (expert placement records, dht/expert_records.py).
* index keys: a value wins when it carries news (a record newer than any the
  other values hold for that peer); the last such value wins; with no news
  anywhere the first (stored) value stays.

``MergingValueStore`` (a ValueStore subclass) turns "incoming wins" into
"merge incoming into stored" for index keys, prunes expired records on read,
and drops a stored peer record once it has expired. The merged value is
re-wrapped in an unsigned kad Record: the library's own record signature
covers one author's value, and our records carry their own signatures.

Both take an optional ``RecordCache`` (dht/records.py; the DhtNode passes
its own): a stored index value is re-read on every GET, PUT and select, and
each of its records is then checked against the clock only, not its
signature again.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.kad_dht.value_store import ValueStore
from libp2p.records.validator import NamespacedValidator, Validator

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

Clock = Callable[[], int]

# Distinct /meshd/ keys one node stores. A swarm has one peer key per node and
# a model key plus a few span keys per served model; 8192 is far above a home
# swarm and bounds what minted identities can make us hold (each value is
# itself bounded by MAX_INDEX_RECORDS x MAX_RECORD_BYTES).
MAX_STORED_KEYS = 8192


class MeshdValidator(Validator):
    def __init__(self, clock: Clock, cache: RecordCache | None = None) -> None:
        self.clock = clock
        self.cache = cache

    def validate(self, key: str, value: bytes) -> None:
        check_value(key, value, self.clock(), self.cache)

    def select(self, key: str, values: list[bytes]) -> int:
        if not values:
            raise ValueError("select from no values")
        now = self.clock()
        parsed = K.parse_key(key)
        decoded = [_lenient(parsed, v, now, self.cache) for v in values]
        if parsed.kind == "peer":
            seqs = [max((r.sequence for r in recs), default=-1) for recs in decoded]
            return seqs.index(max(seqs))
        winner = 0
        for i, recs in enumerate(decoded):
            others = [r for j, rs in enumerate(decoded) if j != i for r in rs]
            if news(recs, others) > 0:
                winner = i
        return winner


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


def _lenient(parsed: K.ParsedKey, value: bytes, now_ms: int,
             cache: RecordCache | None = None) -> list[CapabilityRecord]:
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


def namespaced_validator(clock: Clock, cache: RecordCache | None = None) -> NamespacedValidator:
    return NamespacedValidator({K.NAMESPACE: MeshdValidator(clock, cache)}, strict_validation=True)


class MergingValueStore(ValueStore):
    """ValueStore whose index keys merge instead of replace (see module docstring)."""

    def __init__(self, host, local_peer_id, clock: Clock, cache: RecordCache | None = None) -> None:
        super().__init__(host=host, local_peer_id=local_peer_id)
        self.clock = clock
        self.cache = cache

    def put_record(self, key: bytes, record: Record) -> None:
        parsed = _parse(key)
        if key not in self.store and len(self.store) >= MAX_STORED_KEYS:
            self.cleanup_expired()
            if len(self.store) >= MAX_STORED_KEYS:
                raise RecordRejected("too_large", f"this node already stores {MAX_STORED_KEYS} keys")
        if parsed is None or parsed.kind == "peer":
            super().put_record(key, record)
            return
        now = self.clock()
        current = self._stored_records(key, parsed, now)
        merged = merge_records(current, _lenient(parsed, record.value, now, self.cache), now)
        if not merged:
            self.remove(key)
            return
        fresh = Record(key=key, value=encode_record_set(merged), timeReceived=record.timeReceived)
        super().put_record(key, fresh)

    def get(self, key: bytes) -> Record | None:
        record = super().get(key)
        parsed = _parse(key)
        if record is None or parsed is None:
            return record
        now = self.clock()
        records = _lenient(parsed, record.value, now, self.cache)
        if not records:
            self.remove(key)
            return None
        if parsed.kind != "peer":
            value = encode_record_set(records)
            if value != record.value:
                record = Record(key=key, value=value, timeReceived=record.timeReceived)
                super().put_record(key, record)
        return record

    def _stored_records(self, key: bytes, parsed: K.ParsedKey, now: int) -> list[CapabilityRecord]:
        entry = self.store.get(key)
        return _lenient(parsed, entry[0].value, now, self.cache) if entry else []

    def index_keys(self) -> list[str]:
        out = []
        for key in list(self.store):
            parsed = _parse(key)
            if parsed is not None and parsed.kind == "model":
                out.append(key.decode())
        return out


def _parse(key: bytes) -> K.ParsedKey | None:
    try:
        return K.parse_key(key.decode())
    except (UnicodeDecodeError, ValueError):
        return None
