"""The route driver's failover over real sockets: in-process shards behind real gRPC servers on loopback.

The driver, push and failover unit tests run in memory (tests/test_swarm_driver.py,
tests/test_push_driver.py); these few check that what they prove holds over the
real edge: a server stopped mid-decode (its streams reset), a worker whose
forwards are held (its streams stay open and silent), and pushed rows that
travel worker to worker over loopback gRPC.
"""
from __future__ import annotations

import time

import pytest

from meshd.generate.driver import SwarmDriver
from meshd.generate.push import PushDriver
from meshd.generate.routes import AdsRouteSource, PeerConnector
from meshd.generate.transports import GrpcTransport
from meshd.reach.tls import loopback_channel
from shard.edges.grpc_server import GRPC_OPTIONS
from tests._swarm_helpers import NUM_LAYERS, PROMPT, request, start_shard, tiny_llama, whole_tokens

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


def _loopback_dialer(target):
    return GrpcTransport(loopback_channel(target.endpoint, GRPC_OPTIONS))


@pytest.fixture
def shards():
    made = [start_shard(tiny_llama(), "peer-a", 0, 2), start_shard(tiny_llama(), "peer-b", 2, 4),
            start_shard(tiny_llama(), "peer-c", 4, 6), start_shard(tiny_llama(), "peer-d", 2, 6)]
    for s in made:
        s.service.push_dialer = _loopback_dialer
    yield {s.peer_id: s for s in made}
    for s in made:
        s.kill()


def driver_for(shards, topology: str):
    costs = {"peer-a": 1.0, "peer-b": 1.0, "peer-c": 1.0, "peer-d": 5.0}
    fp = shards["peer-a"].service.backend.fingerprint
    source = AdsRouteSource(lambda: [s.ad(NUM_LAYERS, costs[p]) for p, s in shards.items()],
                            fp.model_artifact_digest, NUM_LAYERS, entry_peer_id="entry",
                            recipe_digest=fp.runtime_recipe_digest)
    connector = PeerConnector(insecure_loopback=True)
    if topology == "star":
        return SwarmDriver(source, connector, fingerprint=fp, replan_wait_s=0.0)
    return PushDriver(source, connector, fingerprint=fp, replan_wait_s=0.0, topology="push")


@pytest.mark.parametrize("topology", ["star", "push"])
def test_a_server_stopped_mid_decode_is_replaced_with_identical_tokens(shards, topology):
    driver = driver_for(shards, topology)
    tokens = []
    for token in driver.generate(request(NEW_TOKENS)):
        tokens.append(token.id)
        if len(tokens) == 5:
            shards["peer-b"].kill()
    assert tokens == whole_tokens(NEW_TOKENS)
    (event,) = driver.stats.failovers
    # a pushed route has the next step in flight when the entry sees a token: it may pass B first
    positions = {len(PROMPT) + 5} if topology == "star" else {len(PROMPT) + 5, len(PROMPT) + 6}
    assert event.failed_peer == "peer-b" and event.position in positions
    assert driver.stats.routes[-1].peers == ("peer-a", "peer-d")
    if topology == "push":
        assert set(driver.stats.step_legs[-3:]) == {2 + 1}   # pushed worker to worker over gRPC
    assert all(shards[p].active_sessions() == 0 for p in ("peer-a", "peer-d"))


@pytest.mark.parametrize("topology", ["star", "push"])
def test_a_worker_whose_forwards_are_held_is_cut_by_its_deadline_and_replaced(shards, topology):
    from meshd.generate.deadlines import DECODE_FLOOR_S

    driver = driver_for(shards, topology)
    lock = shards["peer-b"].service.lock
    tokens, times = [], []
    try:
        for token in driver.generate(request(NEW_TOKENS)):
            tokens.append(token.id)
            times.append(time.monotonic())
            if len(tokens) == 4:
                lock.acquire()
    finally:
        if lock.locked():
            lock.release()
    assert tokens == whole_tokens(NEW_TOKENS)
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b"
    # the stall is never shorter than the deadline's floor (a step already past B when it froze may
    # still arrive first: a pushed route has the next token in flight)
    assert max(b - a for a, b in zip(times[3:], times[4:])) >= DECODE_FLOOR_S
