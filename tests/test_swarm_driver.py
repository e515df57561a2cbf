"""The route driver over real in-process gRPC shards: exact tokens, failover, cancellation.

Three shards of a tiny random Llama (6 layers): A serves [0,3), B [3,6) and
C [2,6) (overlapping, and more expensive per layer), so the cheapest route
is A -> B; killing B's server mid-decode must move to C with effective start
3, re-prefill C from the kept boundary rows, and still give the whole
model's greedy tokens. Cancellation and early close release every hop's KV.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from meshd.errors import HopFailure
from meshd.generate.driver import GenerationCancelled, GenerationRequest, RouteFailed, SwarmDriver, collect
from meshd.generate.routes import AdsRouteSource, PeerConnector
from shard.reference import WholeModel
from shard.sampling import SamplingSpec
from meshd.testing.models import build_random_llama
from tests._swarm_helpers import start_shard

NUM_LAYERS = 6
PROMPT = tuple(range(5, 45))  # 40 tokens: three prefill chunks of 16
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_llama(seed=3)


@pytest.fixture(scope="module")
def reference(model):
    return WholeModel(model).generate(list(PROMPT), NEW_TOKENS, chunk_tokens=16).tokens


@pytest.fixture
def shards(model):
    made = [start_shard(model, "peer-a", 0, 3), start_shard(model, "peer-b", 3, 6),
            start_shard(model, "peer-c", 2, 6)]
    yield {s.peer_id: s for s in made}
    for s in made:
        s.kill()


def driver_for(shards, **kw) -> SwarmDriver:
    alive = dict(shards)
    costs = {"peer-a": 1.0, "peer-b": 1.0, "peer-c": 5.0}
    fp = next(iter(shards.values())).service.backend.fingerprint
    source = AdsRouteSource(lambda: [s.ad(NUM_LAYERS, costs[p]) for p, s in alive.items()],
                            fp.model_artifact_digest, NUM_LAYERS, entry_peer_id="entry",
                            recipe_digest=fp.runtime_recipe_digest)
    return SwarmDriver(source, PeerConnector(insecure_loopback=True), fingerprint=fp, replan_wait_s=0.0, **kw)


def request(**kw) -> GenerationRequest:
    return GenerationRequest(PROMPT, NEW_TOKENS, chunk_tokens=16, **kw)


def test_tokens_equal_whole_model(shards, reference):
    driver = driver_for(shards)
    assert collect(driver, request()) == reference
    assert driver.stats.routes[0].peers == ("peer-a", "peer-b")
    assert not driver.stats.failovers
    assert all(s.active_sessions() == 0 for s in shards.values())  # released on every hop


def test_killed_hop_mid_decode_fails_over_with_identical_tokens(shards, reference):
    driver = driver_for(shards)
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token)
        if len(tokens) == 7:
            shards["peer-b"].kill()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and event.position == len(PROMPT) + 7
    hops = driver.stats.routes[-1].hops
    assert [(h.peer_id, h.effective_start) for h in hops] == [("peer-a", 0), ("peer-c", 3)]
    assert event.reprefilled == (1,)
    assert shards["peer-a"].active_sessions() == 0 and shards["peer-c"].active_sessions() == 0


def test_killed_hop_before_the_first_token_fails_over(shards, reference):
    shards["peer-b"].kill()
    driver = driver_for(shards)
    assert collect(driver, request()) == reference
    assert driver.stats.failovers[0].failed_peer == "peer-b"


def test_head_failure_without_replacement_is_a_clear_error(shards):
    driver = driver_for(shards)
    gen = driver.generate(request())
    next(gen)
    shards["peer-a"].kill()
    with pytest.raises(RouteFailed, match="no route"):
        list(gen)


def test_seeded_sampling_is_reproducible_across_a_failover(shards):
    spec = SamplingSpec(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    first = collect(driver_for(shards), request(sampling=spec))
    driver = driver_for(shards)
    second = []
    for token in driver.generate(request(sampling=spec)):
        second.append(token)
        if len(second) == 3:
            shards["peer-b"].kill()
    assert second == first and driver.stats.failovers


def test_stop_token_ends_early(shards, reference):
    stop = reference[5]
    tokens = collect(driver_for(shards), request(stop_ids=frozenset({stop})))
    assert tokens == reference[:reference.index(stop) + 1]


def test_cancel_releases_kv_on_every_hop(shards):
    driver = driver_for(shards)
    gen = driver.generate(request())
    next(gen)
    assert shards["peer-a"].active_sessions() == 1 and shards["peer-b"].active_sessions() == 1
    threading.Thread(target=driver.cancel).start()
    with pytest.raises(GenerationCancelled):
        list(gen)
    assert all(s.active_sessions() == 0 for s in shards.values())


def test_closing_the_stream_early_releases_kv(shards):
    gen = driver_for(shards).generate(request())
    next(gen)
    gen.close()
    assert all(s.active_sessions() == 0 for s in shards.values())


def test_hop_failure_names_the_hop():
    err = HopFailure(2, "peer-x" * 4, "transport: UNAVAILABLE")
    assert err.index == 2 and "hop 2" in str(err) and "UNAVAILABLE" in str(err)


def test_a_hop_silent_past_its_step_deadline_is_replaced(shards, reference):
    """B stops answering (its session lock is held): the watchdog cuts the call, C takes over."""
    driver = driver_for(shards, step_deadline_s=1.0)
    lock = shards["peer-b"].service.lock
    tokens = []
    try:
        for token in driver.generate(request()):
            tokens.append(token)
            if len(tokens) == 4:
                lock.acquire()
    finally:
        if lock.locked():
            lock.release()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and "CANCELLED" in event.detail
