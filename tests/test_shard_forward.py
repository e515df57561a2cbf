"""The push topology's worker side, sans-I/O: who may attach, push, repoint and release
(shard/push/hub.py, the stream core's push actions carried out by shard/push/actions.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.testing import models as testmodels
from proto import shard_runtime_pb2 as pb
from proto.errors import ProtocolViolation
from shard.errors import CacheMiss
from shard.model.torch_backend import TorchRangeBackend
from shard.push import actions, hub
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy
from shard.session.stream import AttachFeeder, OpenPushed, ReleasePushed, SessionStream


@pytest.fixture(scope="module")
def head():
    torch.set_num_threads(1)
    backend = TorchRangeBackend.load(testmodels.build_random_llama(), 0, 3, progress=None)
    return ShardService(backend, SessionPolicy(kv_budget_tokens=4096))


@pytest.fixture(scope="module")
def tail():
    backend = TorchRangeBackend.load(testmodels.build_random_llama(), 3, 6, progress=None)
    return ShardService(backend, SessionPolicy(kv_budget_tokens=4096))


def _open(svc, session="s", **kw) -> bytes:
    lr = svc.backend.layer_range
    return pb.SessionRequest(open=pb.SessionOpen(
        schema_version=pb.SCHEMA_VERSION_1, route_session_id=session, route_epoch=0,
        fingerprint=svc.backend.fingerprint, max_tokens=64,
        shard_range=pb.ShardRange(start_layer=lr.start, end_layer=lr.end, effective_start_layer=lr.start),
        tail=pb.TailOptions(sample=True) if lr.is_tail else None, **kw)).SerializeToString()


def _kinds(bodies):
    return [pb.SessionResponse.FromString(b) for b in bodies]


TARGET = pb.PushTarget(peer_id="peer-next", endpoint="127.0.0.1:1", shard_range=pb.ShardRange(
    start_layer=3, end_layer=6, effective_start_layer=3))


def test_a_feeder_attaches_only_to_a_session_the_entry_opened(tail):
    (resp,) = _kinds(actions.receive(SessionStream(tail), _open(tail, "nobody-opened-this", push_feed=True)))
    assert resp.status.error.code == pb.ERROR_CODE_CACHE_MISS and resp.status.terminal
    control = SessionStream(tail)
    (acc,) = _kinds(actions.receive(control, _open(tail, "opened", push=True)))
    assert acc.WhichOneof("kind") == "accepted" and actions.sink_of(control) is not None
    feeder = SessionStream(tail)
    (acc,) = _kinds(actions.receive(feeder, _open(tail, "opened", push_feed=True)))
    assert acc.WhichOneof("kind") == "accepted" and actions.sink_of(feeder) is None   # it answers credits only
    release = pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="opened")).SerializeToString()
    (resp,) = _kinds(actions.receive(feeder, release))
    assert resp.status.error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION          # only the entry releases
    actions.receive(control, release)
    with pytest.raises(CacheMiss):
        hub.hub_of(tail).get(control.key)                                     # forgotten on release


def test_a_pushed_non_tail_needs_a_target_and_a_dialer(head):
    (resp,) = _kinds(actions.receive(SessionStream(head), _open(head, "no-target", push=True)))
    assert resp.status.error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION and "push_next" in resp.status.error.detail
    head.push_dialer = None
    (resp,) = _kinds(actions.receive(SessionStream(head), _open(head, "no-dialer", push=True, push_next=TARGET)))
    assert "cannot push" in resp.status.error.detail
    assert head.health().active_sessions == 0                                      # the refused open kept no KV


def test_repoint_is_only_for_the_entry_stream_of_a_pushed_hop(tail):
    plain = SessionStream(tail)
    plain.receive(_open(tail, "plain"))
    (resp,) = _kinds(plain.receive(pb.SessionRequest(repoint=pb.PushRepoint(next=TARGET)).SerializeToString()))
    assert resp.status.error.code == pb.ERROR_CODE_PROTOCOL_VIOLATION


@settings(max_examples=100, deadline=None)
@given(peer=st.text(max_size=40), endpoint=st.text(max_size=400), pin=st.binary(max_size=40))
def test_push_targets_are_checked_with_a_typed_error(peer, endpoint, pin):
    target = pb.PushTarget(peer_id=peer, endpoint=endpoint, tls_cert_sha256=pin)
    ok = bool(peer) and bool(endpoint) and len(endpoint) <= 300 and len(pin) in (0, 32)
    if ok:
        hub.check_target(target)
    else:
        with pytest.raises(ProtocolViolation):
            hub.check_target(target)


def test_the_stream_core_returns_push_actions_and_the_edge_carries_them_out(tail):
    # h11 style: the core says what a pushed session needs; nothing is registered until the edge
    # carries the action out (shard/push/actions.py), and only then is the open answered.
    core = SessionStream(tail)
    (opened,) = core.receive(_open(tail, "acted", push=True))
    assert isinstance(opened, OpenPushed) and opened.key.session_id == "acted"
    with pytest.raises(CacheMiss):
        hub.hub_of(tail).get(opened.key)
    assert actions.carry(core, [opened]) == [opened.accepted]
    assert hub.hub_of(tail).get(opened.key) is core.push and core.push_role == "control"
    (attach,) = SessionStream(tail).receive(_open(tail, "acted", push_feed=True))
    assert isinstance(attach, AttachFeeder) and attach.key == opened.key
    release = pb.SessionRequest(release=pb.ReleaseSignal(route_session_id="acted")).SerializeToString()
    out = core.receive(release)
    assert isinstance(out[0], ReleasePushed) and _kinds(out[1:])[0].WhichOneof("kind") == "ack"
    assert hub.hub_of(tail).get(opened.key) is core.push          # still registered: not carried out yet
    assert actions.carry(core, out) == out[1:]
    with pytest.raises(CacheMiss):
        hub.hub_of(tail).get(opened.key)
