"""The route driver over real in-process gRPC shards: exact tokens, failover, cancellation.

Three shards of a tiny random Llama (6 layers): A serves [0,3), B [3,6) and
C [2,6) (overlapping, and more expensive per layer), so the cheapest route
is A -> B; killing B's server mid-decode must move to C with effective start
3, re-prefill C from the kept boundary rows, and still give the whole
model's greedy tokens. Cancellation and early close release every hop's KV.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from meshd.errors import HopFailure
from meshd.generate.driver import GenerationCancelled, GenerationRequest, RouteFailed, SwarmDriver, collect
from meshd.generate.routes import AdsRouteSource, PeerConnector
from proto.errors import LocalError
from shard.model.reference import WholeModel
from shard.model.sampling import SamplingSpec
from tests._swarm_helpers import start_shard

NUM_LAYERS = 6
PROMPT = tuple(range(5, 45))  # 40 tokens: three prefill chunks of 16
NEW_TOKENS = 24


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
        tokens.append(token.id)
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
        second.append(token.id)
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
    """B stops answering mid-decode (its session lock is held): its deadline, derived from its
    own decode steps (milliseconds here, so the DECODE_FLOOR_S floor), cuts the call and C
    takes over within a few seconds."""
    from meshd.generate.deadlines import DECODE_FLOOR_S

    driver = driver_for(shards)
    lock = shards["peer-b"].service.lock
    tokens, times = [], []
    try:
        for token in driver.generate(request()):
            tokens.append(token.id)
            times.append(time.monotonic())
            if len(tokens) == 4:
                lock.acquire()
    finally:
        if lock.locked():
            lock.release()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and "step deadline" in event.detail
    stall = times[4] - times[3]
    print(f"silent hop: next token {stall:.2f} s after the freeze")
    assert stall >= DECODE_FLOOR_S     # never cut before its deadline (the bound above it is a slow test's)


def test_a_silent_hop_without_replacement_is_retried_with_more_patience(shards, reference):
    """Only A -> B exists: B silent for a while (3 s) is cut, then retried on the same peer
    (fresh session, re-prefilled, doubled patience): the generation finishes, same tokens."""
    shards.pop("peer-c").kill()
    driver = driver_for(shards)
    lock = shards["peer-b"].service.lock
    tokens = []
    release = threading.Timer(3.0, lock.release)
    try:
        for token in driver.generate(request()):
            tokens.append(token.id)
            if len(tokens) == 4:
                lock.acquire()
                release.start()
    finally:
        release.join()
    assert tokens == reference
    assert [e.failed_peer for e in driver.stats.failovers] == ["peer-b"]
    assert [h.peer_id for h in driver.stats.routes[-1].hops] == ["peer-a", "peer-b"]


def test_the_tail_sends_only_the_token(shards, reference):
    from proto.limits import MAX_TAIL_BYTES_PER_DECODE_STEP

    driver = driver_for(shards)
    tokens = list(driver.generate(request()))
    assert [t.id for t in tokens] == reference and all(t.logprob is None and t.top == () for t in tokens)
    stats = driver.stats
    assert len(stats.step_tail_bytes) == NEW_TOKENS - 1 and stats.logits == []
    print(f"tail bytes per decode step: {stats.tail_bytes_per_decode_step:.1f} (max {max(stats.step_tail_bytes)})")
    assert stats.tail_bytes_per_decode_step <= MAX_TAIL_BYTES_PER_DECODE_STEP
    assert max(stats.step_tail_bytes) <= MAX_TAIL_BYTES_PER_DECODE_STEP
    assert len(stats.step_wall_ns) == len(stats.step_execution_ns) == NEW_TOKENS - 1
    assert all(w > e > 0 for w, e in zip(stats.step_wall_ns, stats.step_execution_ns))
    assert 0 < stats.prefill_s < stats.token_times[-1] - stats.started_at


def test_logits_and_logprobs_only_when_asked(shards, model):
    from shard.model.sampling import sample_token, token_logprobs

    spec = SamplingSpec(temperature=0.9, top_k=30, seed=5)
    whole = WholeModel(model).generate(list(PROMPT), NEW_TOKENS, chunk_tokens=16)
    driver = driver_for(shards)
    tokens = list(driver.generate(request(sampling=spec, return_logits=True, top_logprobs=4)))
    logits = driver.stats.logits
    assert len(logits) == len(tokens) == NEW_TOKENS
    assert float(np.abs(logits[0] - whole.logits[0]).max()) == 0.0       # same inputs: the same row
    assert max(driver.stats.step_tail_bytes) > 4 * logits[0].size        # the rows did travel
    for i, (token, row) in enumerate(zip(tokens, logits)):
        assert token.id == sample_token(row, spec, len(PROMPT) + i)      # the tail's draw: (seed, position)
        lp, top = token_logprobs(row, token.id, 4)
        assert token.logprob == pytest.approx(lp, abs=1e-5) and len(token.top) == 4
        assert [t for t, _ in token.top] == [t for t, _ in top]
    only_lp = list(driver_for(shards).generate(request(sampling=spec, logprobs=True)))
    assert [t.id for t in only_lp] == [t.id for t in tokens]
    assert all(t.logprob is not None and t.top == () for t in only_lp)
    with pytest.raises(LocalError, match="top_logprobs"):
        request(top_logprobs=21)


def test_a_fixed_route_needs_no_swarm(shards, reference):
    from meshd.generate.routes import discover_fingerprint, fixed_route

    a, b = shards["peer-a"], shards["peer-b"]
    assert a.service.validate().validated and b.service.validate().validated
    source = fixed_route([(a.endpoint, 0, 3), (b.endpoint, 3, 6)], NUM_LAYERS)
    connector = PeerConnector(insecure_loopback=True)
    fp = discover_fingerprint(connector, source.route)
    assert fp == a.service.backend.fingerprint
    assert collect(SwarmDriver(source, connector, fingerprint=fp), request()) == reference
    driver = SwarmDriver(source, connector, fingerprint=fp)
    gen = driver.generate(request())
    next(gen)
    b.kill()
    t0 = time.monotonic()
    with pytest.raises(RouteFailed, match="no live peer serves layer"):
        list(gen)
    assert time.monotonic() - t0 < 10      # no waiting for a swarm that is not there
    assert a.active_sessions() == 0


def test_a_failover_looks_in_the_cached_snapshot_before_reading_the_dht(shards, reference):
    """A fresh DHT read can wait seconds on the very peer that froze: the latest snapshot first."""
    fp = shards["peer-a"].service.backend.fingerprint
    costs = {"peer-a": 1.0, "peer-b": 1.0, "peer-c": 5.0}
    reads = []

    def ads():
        reads.append(1)
        return [s.ad(NUM_LAYERS, costs[p]) for p, s in shards.items()]

    source = AdsRouteSource(ads, fp.model_artifact_digest, NUM_LAYERS, entry_peer_id="entry",
                            recipe_digest=fp.runtime_recipe_digest,
                            cached=lambda: [s.ad(NUM_LAYERS, costs[p]) for p, s in shards.items()])
    driver = SwarmDriver(source, PeerConnector(insecure_loopback=True), fingerprint=fp, replan_wait_s=0.0)
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == 5:
            shards["peer-b"].kill()
    assert tokens == reference and len(driver.stats.failovers) == 1
    assert len(reads) == 1                      # the first plan only
