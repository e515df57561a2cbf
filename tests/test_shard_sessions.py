"""Session manager rules with a fake clock and a tiny real backend."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from meshd.testing import models as testmodels
from proto.errors import LimitExceeded, ProtocolViolation
from shard.errors import (
    CacheMiss,
    Cancelled,
    EpochStale,
    InternalError,
    ResourceExhausted,
    to_shard_error,
)
from shard.model.torch_backend import TorchRangeBackend
from shard.session.sessions import SessionKey, SessionManager, SessionPolicy

torch.set_num_threads(1)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def head():
    return TorchRangeBackend.load(testmodels.build_random_llama(), 0, 3, progress=None)


@pytest.fixture()
def clock():
    return FakeClock()


def manager(backend, clock, **kw):
    return SessionManager(backend, SessionPolicy(**{"kv_budget_tokens": 256, **kw}), clock)


def ids(*values):
    return np.array(values, dtype=np.int64)


def test_prefill_then_decode_and_interleaving_isolated(head, clock):
    m = manager(head, clock)
    a, b = SessionKey("a", 0), SessionKey("b", 0)
    assert m.open(a, 64) == 0 and m.open(b, 64) == 0
    ra = m.step(a, step=1, position=0, expected_past_len=0, inputs=ids(1, 2, 3), effective_start=0)
    rb = m.step(b, step=1, position=0, expected_past_len=0, inputs=ids(9, 8), effective_start=0)
    ra2 = m.step(a, step=2, position=3, expected_past_len=3, inputs=ids(4), effective_start=0)
    assert (ra.past_len, rb.past_len, ra2.past_len) == (3, 2, 4)
    # Same result as a solo session with the same tokens: b did not disturb a.
    solo = SessionKey("solo", 0)
    m.open(solo, 64)
    m.step(solo, step=1, position=0, expected_past_len=0, inputs=ids(1, 2, 3), effective_start=0)
    rs = m.step(solo, step=2, position=3, expected_past_len=3, inputs=ids(4), effective_start=0)
    assert np.array_equal(rs.payload, ra2.payload)
    assert m.stats().kv_cached_tokens == 4 + 2 + 4


def test_cache_miss_carries_actual_length_and_applies_nothing(head, clock):
    m = manager(head, clock)
    k = SessionKey("s", 1)
    m.open(k, 32)
    m.step(k, step=1, position=0, expected_past_len=0, inputs=ids(1, 2), effective_start=0)
    with pytest.raises(CacheMiss) as err:
        m.step(k, step=2, position=5, expected_past_len=5, inputs=ids(3), effective_start=0)
    assert err.value.actual_past_len == 2
    assert to_shard_error(err.value).actual_past_len == 2
    assert m.past_len(k) == 2
    with pytest.raises(CacheMiss) as err:
        m.step(SessionKey("unknown", 0), step=1, position=0, expected_past_len=0, inputs=ids(1),
               effective_start=0)
    assert err.value.actual_past_len == 0
    with pytest.raises(ProtocolViolation):
        m.step(k, step=2, position=3, expected_past_len=2, inputs=ids(3), effective_start=0)


def test_duplicate_step_acknowledged_not_reapplied(head, clock):
    m = manager(head, clock)
    k = SessionKey("d", 0)
    m.open(k, 32)
    first = m.step(k, step=7, position=0, expected_past_len=0, inputs=ids(1, 2), effective_start=0)
    again = m.step(k, step=7, position=0, expected_past_len=0, inputs=ids(1, 2), effective_start=0)
    assert again.duplicate and again.past_len == 2 and np.array_equal(again.payload, first.payload)
    older = m.step(k, step=3, position=0, expected_past_len=0, inputs=ids(1, 2), effective_start=0)
    assert older.duplicate and older.payload is None and m.past_len(k) == 2


def test_stale_epoch_refused_and_new_epoch_supersedes(head, clock):
    m = manager(head, clock)
    old, new = SessionKey("r", 1), SessionKey("r", 2)
    m.open(old, 32)
    m.step(old, step=1, position=0, expected_past_len=0, inputs=ids(1), effective_start=0)
    m.open(new, 32)
    assert m.past_len(old) is None  # freed by the newer epoch
    with pytest.raises(EpochStale):
        m.step(old, step=2, position=1, expected_past_len=1, inputs=ids(2), effective_start=0)
    with pytest.raises(EpochStale):
        m.open(old, 32)


def test_release_frees_at_once_and_is_idempotent(head, clock):
    m = manager(head, clock, kv_budget_tokens=64)
    k = SessionKey("x", 0)
    m.open(k, 64)
    assert m.stats().kv_reserved_tokens == 64
    assert m.release(k) is True and m.release(k) is False
    assert m.stats().kv_reserved_tokens == 0
    m.open(SessionKey("y", 0), 64)  # the room is available immediately


def test_ttl_expiry(head, clock):
    m = manager(head, clock, ttl_s=10)
    k = SessionKey("t", 0)
    m.open(k, 16)
    clock.t += 9
    m.step(k, step=1, position=0, expected_past_len=0, inputs=ids(1), effective_start=0)
    clock.t += 9.5
    assert m.expire() == []
    clock.t += 1
    assert m.expire() == [k] and m.stats().active_sessions == 0
    with pytest.raises(CacheMiss):
        m.step(k, step=2, position=1, expected_past_len=1, inputs=ids(2), effective_start=0)


def test_lru_eviction_and_budget_refusal(head, clock):
    m = manager(head, clock, kv_budget_tokens=100, min_idle_before_evict_s=5)
    a, b, c, d = (SessionKey(n, 0) for n in "abcd")
    m.open(a, 40)
    clock.t += 1
    m.open(b, 40)
    clock.t += 1
    with pytest.raises(ResourceExhausted) as err:  # both in active use
        m.open(c, 40)
    assert err.value.retry_after_ms == 3000 and to_shard_error(err.value).retryable
    clock.t += 3  # a has been idle 5 s; b 4 s
    m.open(c, 40)
    assert m.past_len(a) is None and m.past_len(b) == 0  # LRU a evicted, b kept
    m.step(b, step=1, position=0, expected_past_len=0, inputs=ids(1), effective_start=0)
    clock.t += 10
    m.step(b, step=2, position=1, expected_past_len=1, inputs=ids(2), effective_start=0)  # b is fresh
    m.open(d, 40)  # c is the LRU one now
    assert m.past_len(c) is None and m.past_len(b) == 2
    with pytest.raises(ResourceExhausted) as err:
        m.open(SessionKey("huge", 0), 101)
    assert not to_shard_error(err.value).retryable


def test_max_sessions_bound(head, clock):
    m = manager(head, clock, max_sessions=2, min_idle_before_evict_s=100)
    m.open(SessionKey("a", 0), 1)
    m.open(SessionKey("b", 0), 1)
    with pytest.raises(ResourceExhausted):
        m.open(SessionKey("c", 0), 1)


def test_cancel(head, clock):
    m = manager(head, clock)
    k = SessionKey("c", 3)
    m.open(k, 16)
    assert m.cancel(k) == 1
    with pytest.raises(Cancelled):
        m.step(k, step=1, position=0, expected_past_len=0, inputs=ids(1), effective_start=0)
    with pytest.raises(Cancelled):
        m.open(k, 16)
    m.open(SessionKey("c", 4), 16)  # a new epoch continues


def test_bad_inputs_and_reservation(head, clock):
    m = manager(head, clock)
    k = SessionKey("b", 0)
    m.open(k, 4)
    for bad in (np.array([1.0]), ids(), ids(10_000), np.zeros((1, 1), np.int64)):
        with pytest.raises(ProtocolViolation):
            m.step(k, step=1, position=0, expected_past_len=0, inputs=bad, effective_start=0)
    with pytest.raises(LimitExceeded):
        m.step(k, step=1, position=0, expected_past_len=0, inputs=ids(1, 2, 3, 4, 5), effective_start=0)
    with pytest.raises(ProtocolViolation):
        SessionKey("", 0)
    with pytest.raises(ProtocolViolation):
        SessionKey("x" * 129, 0)


def test_backend_failure_resets_cache(head, clock):
    m = manager(head, clock)
    k = SessionKey("f", 0)
    m.open(k, 16)
    m.step(k, step=1, position=0, expected_past_len=0, inputs=ids(1), effective_start=0)

    def boom(_):
        raise RuntimeError("secret path /etc/x")

    with pytest.raises(InternalError) as err:
        m.step(k, step=2, position=1, expected_past_len=1, inputs=ids(2), effective_start=0, post=boom)
    assert "secret" not in to_shard_error(err.value).detail
    with pytest.raises(CacheMiss) as miss:
        m.step(k, step=3, position=2, expected_past_len=2, inputs=ids(3), effective_start=0)
    assert miss.value.actual_past_len == 0
    assert to_shard_error(RuntimeError("x")).code == to_shard_error(err.value).code
