"""RecordCache (dht/records.py): a record's signature is checked once per node, its clock every time.

Pure: signed records from tests/_daemon_helpers.py, explicit clocks."""
from __future__ import annotations

import pytest

from dht import keys as K
from dht.errors import RecordRejected
from dht.records import RecordCache, parse_record_set_lenient, validate_capability
from dht.validator import check_value
from tests._daemon_helpers import DIGEST, NOW_MS, TTL_MS, as_record_set, forged_records, good, identity


def test_a_hit_returns_the_checked_record_and_still_checks_the_clock():
    cache = RecordCache()
    raw = good(identity(1), now=NOW_MS)
    first = validate_capability(raw, NOW_MS, cache)
    assert (cache.hits, cache.misses, len(cache)) == (0, 1, 1)
    again = validate_capability(raw, NOW_MS + 1000, cache)
    assert again is first and (cache.hits, cache.misses) == (1, 1)
    # the same bytes once their lifetime is over: refused although remembered
    with pytest.raises(RecordRejected) as exc:
        validate_capability(raw, NOW_MS + TTL_MS, cache)
    assert exc.value.reason == "expired" and cache.hits == 2
    # and the uncached path agrees
    with pytest.raises(RecordRejected):
        validate_capability(raw, NOW_MS + TTL_MS)


@pytest.mark.parametrize("name", ["forged_signature", "key_peer_id_mismatch", "expired", "future_dated",
                                  "unknown_schema"])
def test_a_rejected_record_is_never_remembered(name):
    cache = RecordCache()
    raw = forged_records(identity(2), identity(3))[name]
    for _ in range(2):          # rejected the second time too, by the full check (a miss each time)
        with pytest.raises(RecordRejected):
            validate_capability(raw, NOW_MS, cache)
    assert len(cache) == 0 and cache.hits == 0 and cache.misses == 2


def test_a_future_dated_record_is_accepted_once_its_time_comes_and_only_then_remembered():
    cache = RecordCache()
    raw = forged_records(identity(2), identity(3))["future_dated"]
    with pytest.raises(RecordRejected):
        validate_capability(raw, NOW_MS, cache)
    later = NOW_MS + 3_600_000
    assert validate_capability(raw, later, cache).peer_id == identity(2).peer_id
    assert len(cache) == 1


def test_the_cache_is_bounded_and_forgets_the_least_recently_used():
    cache = RecordCache(capacity=3)
    raws = [good(identity(10 + i), now=NOW_MS) for i in range(4)]
    for raw in raws[:3]:
        validate_capability(raw, NOW_MS, cache)
    validate_capability(raws[0], NOW_MS, cache)          # raws[0] is now the most recent
    validate_capability(raws[3], NOW_MS, cache)          # evicts raws[1], the least recent
    assert len(cache) == 3
    assert cache.get(raws[1]) is None
    assert all(cache.get(r) is not None for r in (raws[0], raws[2], raws[3]))
    with pytest.raises(ValueError):
        RecordCache(capacity=0)


def test_record_sets_and_the_validator_share_one_cache():
    cache = RecordCache()
    raw = good(identity(4), now=NOW_MS, digest=DIGEST)
    value = as_record_set(raw)
    key = K.model_key(DIGEST)
    assert [r.peer_id for r in check_value(key, value, NOW_MS, cache)] == [identity(4).peer_id]
    assert cache.misses == 1
    assert [r.raw for r in parse_record_set_lenient(value, NOW_MS + 1, cache)] == [raw]
    assert cache.hits == 1
    assert parse_record_set_lenient(value, NOW_MS + TTL_MS, cache) == []     # expired: dropped when read
