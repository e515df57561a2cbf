"""Sessions belong to their opener: the manager's rules (fake clock, tiny real backend).

Over real hops (a worker's TLS port, a relayed circuit) see tests/test_shard_ownership_hops.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.testing import models as testmodels
from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolViolation
from relay.transport import stamp_relayed_peer
from shard.errors import CacheMiss, EpochStale, PermissionDenied, ResourceExhausted, to_shard_error
from shard.model.torch_backend import TorchRangeBackend
from shard.session.sessions import LOCAL_OWNER, Owner, SessionKey, SessionManager, SessionPolicy

torch.set_num_threads(1)
ALICE = Owner.of("noise:alice", b"a" * 32)
BOB = Owner.of("noise:bob", b"b" * 32)
ALICE_OTHER_TOKEN = Owner.of("noise:alice", b"c" * 32)   # same peer, another generation


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


def step(m, key, n):
    return m.step(key, step=n + 1, position=n, expected_past_len=n, inputs=np.array([n + 1], np.int64),
                  effective_start=0)


@pytest.mark.parametrize("intruder", [BOB, ALICE_OTHER_TOKEN, LOCAL_OWNER])
def test_only_the_opener_reattaches_supersedes_releases_or_cancels(head, clock, intruder):
    m = manager(head, clock)
    key = SessionKey("s", 1)
    m.open(key, 16, ALICE)
    step(m, key, 0)
    attempts = {
        "re-attach": lambda: m.open(key, 16, intruder),
        "supersede": lambda: m.open(SessionKey("s", 2), 16, intruder),
        "release": lambda: m.release(key, intruder),
        "cancel": lambda: m.cancel(key, intruder),
        "cancel a later epoch": lambda: m.cancel(SessionKey("s", 9), intruder),
    }
    for what, attempt in attempts.items():
        with pytest.raises(PermissionDenied) as err:
            attempt()
        assert to_shard_error(err.value).code == pb.ERROR_CODE_PERMISSION_DENIED, what
    # Untouched: the opener goes on where it was, at its own epoch.
    assert m.open(key, 16, ALICE) == 1
    assert step(m, key, 1).past_len == 2
    assert m.release(key, ALICE) and m.past_len(key) is None


def test_a_later_epoch_by_the_opener_still_supersedes(head, clock):
    m = manager(head, clock)
    m.open(SessionKey("s", 0), 16, ALICE)
    m.open(SessionKey("s", 1), 16, ALICE)
    assert m.past_len(SessionKey("s", 0)) is None
    with pytest.raises(EpochStale):
        m.open(SessionKey("s", 0), 16, ALICE)


def test_owner_token_size_is_bounded():
    for bad in (b"x", b"x" * 15, b"x" * 65):
        with pytest.raises(ProtocolViolation):
            Owner.of("addr:1.2.3.4", bad)
    assert Owner.of("p", b"x" * 16) != Owner.of("p", b"y" * 16)
    assert len(Owner.of("p" * 1000).peer) == 128


def test_a_newcomer_evicts_no_one_elses_live_session(head, clock):
    m = manager(head, clock, kv_budget_tokens=100, min_idle_before_evict_s=2, foreign_idle_evict_s=60)
    alice = SessionKey("a", 0)
    m.open(alice, 60, ALICE)
    clock.t += 30                         # idle 30 s: past the opener's own 2 s, not abandoned
    with pytest.raises(ResourceExhausted) as err:
        m.open(SessionKey("b", 0), 60, BOB)
    assert err.value.retry_after_ms == 30_000          # when alice's session counts as abandoned
    assert m.past_len(alice) == 0
    with pytest.raises(ResourceExhausted):             # another generation of the same peer: the same
        m.open(SessionKey("a2", 0), 60, ALICE_OTHER_TOKEN)
    clock.t += 30                         # idle 60 s: abandoned, evicted for the newcomer
    m.open(SessionKey("b", 0), 60, BOB)
    assert m.past_len(alice) is None
    with pytest.raises(CacheMiss):
        step(m, alice, 0)


def test_eviction_only_under_pressure_and_oldest_first(head, clock):
    m = manager(head, clock, kv_budget_tokens=100, foreign_idle_evict_s=10)
    keys = [SessionKey(n, 0) for n in "abc"]
    for k in keys:
        m.open(k, 30, ALICE)
        clock.t += 1
    clock.t += 200                        # all idle (not yet the 300 s TTL): nothing is evicted without need
    m.open(SessionKey("small", 0), 10, BOB)
    assert all(m.past_len(k) == 0 for k in keys)
    step(m, keys[0], 0)                   # a is the most recently used now
    m.open(SessionKey("big", 0), 30, BOB)  # needs 30 more: the oldest idle one (b) goes
    assert [m.past_len(k) for k in keys] == [1, None, 0]


def test_per_peer_session_quota(head, clock):
    m = manager(head, clock, max_sessions_per_peer=2)
    m.open(SessionKey("a1", 0), 8, ALICE)
    m.open(SessionKey("a2", 0), 8, ALICE_OTHER_TOKEN)      # the quota is per peer, not per token
    with pytest.raises(ResourceExhausted) as err:
        m.open(SessionKey("a3", 0), 8, Owner.of("noise:alice", b"d" * 32))
    assert "per peer" in str(err.value) and err.value.retry_after_ms > 0
    m.open(SessionKey("b1", 0), 8, BOB)                    # another peer is not affected
    m.release(SessionKey("a1", 0), ALICE)
    m.open(SessionKey("a3", 0), 8, Owner.of("noise:alice", b"d" * 32))


# -- the home node's stamp on a relayed session's first frame (relay/transport.py) ---------------

PEER = "12D3KooWcircuitpeer"


def test_the_stamp_overwrites_a_forged_peer_and_keeps_the_rest():
    body = pb.SessionRequest(open=pb.SessionOpen(schema_version=1, route_session_id="s", route_epoch=3,
                                                 owner_token=b"t" * 16, relayed_peer_id="forged")).SerializeToString()
    stamped = pb.SessionRequest.FromString(stamp_relayed_peer(body, PEER))
    assert stamped.open.relayed_peer_id == PEER
    assert (stamped.open.route_session_id, stamped.open.route_epoch, stamped.open.owner_token) == ("s", 3, b"t" * 16)
    with pytest.raises(ProtocolViolation):
        stamp_relayed_peer(body, "?")                      # no authenticated peer: refuse, never "local"
    decode = pb.SessionRequest(decode=pb.DecodeStep(position=1)).SerializeToString()
    assert stamp_relayed_peer(decode, PEER) == decode      # not an open: the worker refuses it unchanged


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_the_stamp_fuzz_returns_the_bytes_or_a_stamped_open(body):
    out = stamp_relayed_peer(body, PEER)
    if out != body:
        assert pb.SessionRequest.FromString(out).open.relayed_peer_id == PEER
