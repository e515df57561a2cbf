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

The rules themselves (validate, select, merge, prune) are pure and live in
dht/kademlia/values.py, where the simulation's nodes use them too; the
classes here adapt them to the library's interfaces.

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
from dht.kademlia import values
from dht.kademlia.values import MAX_STORED_KEYS, check_value
from dht.records import RecordCache

log = logging.getLogger(__name__)

Clock = Callable[[], int]

__all__ = ["MeshdValidator", "MergingValueStore", "namespaced_validator", "check_value", "MAX_STORED_KEYS"]


class MeshdValidator(Validator):
    def __init__(self, clock: Clock, cache: RecordCache | None = None) -> None:
        self.clock = clock
        self.cache = cache

    def validate(self, key: str, value: bytes) -> None:
        check_value(key, value, self.clock(), self.cache)

    def select(self, key: str, values_: list[bytes]) -> int:
        return values.select(key, values_, self.clock(), self.cache)


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
        entry = self.store.get(key)
        value = values.merged(parsed, entry[0].value if entry else None, record.value, self.clock(), self.cache)
        if value is None:
            self.remove(key)
            return
        super().put_record(key, Record(key=key, value=value, timeReceived=record.timeReceived))

    def get(self, key: bytes) -> Record | None:
        record = super().get(key)
        parsed = _parse(key)
        if record is None or parsed is None:
            return record
        value = values.readable(parsed, record.value, self.clock(), self.cache)
        if value is None:
            self.remove(key)
            return None
        if value != record.value:
            record = Record(key=key, value=value, timeReceived=record.timeReceived)
            super().put_record(key, record)
        return record

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
