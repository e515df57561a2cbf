"""The route driver (star) over shards in memory: exact tokens, failover, cancellation.

Three shards of a tiny random Llama (6 layers): A serves [0,3), B [3,6) and
C [2,6) (overlapping, and more expensive per layer), so the cheapest route
is A -> B; killing B mid-decode must move to C with effective start 3,
re-prefill C from the kept boundary rows, and still give the whole model's
greedy tokens. Cancellation and early close release every hop's KV. The
workers are real ShardServices reached through in-memory transports
(shard/edges/memory.py); every fault (a worker killed, frozen, refusing,
sending a bad frame) is the transport's.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from meshd.errors import HopFailure
from meshd.generate.driver import GenerationCancelled, RouteFailed, SwarmDriver, collect
from meshd.generate.routes import AdsRouteSource
from proto.errors import LocalError
from shard.model.reference import WholeModel
from shard.model.sampling import SamplingSpec
from tests._swarm_helpers import CHUNK, NUM_LAYERS, PROMPT, MemorySwarm, whole_tokens
from tests._swarm_helpers import request as make_request

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference():
    return whole_tokens(NEW_TOKENS)


@pytest.fixture
def swarm():
    swarm = MemorySwarm()
    swarm.start("peer-a", 0, 3)
    swarm.start("peer-b", 3, 6)
    swarm.start("peer-c", 2, 6, cost=5.0)
    return swarm


def request(**kw):
    return make_request(NEW_TOKENS, **kw)


def test_tokens_equal_whole_model(swarm, reference):
    before = set(threading.enumerate())
    driver = swarm.driver()
    tokens, during = [], set()
    for token in driver.generate(request()):
        tokens.append(token.id)
        during |= set(threading.enumerate()) - before
    assert tokens == reference
    assert driver.stats.routes[0].peers == ("peer-a", "peer-b")
    assert not driver.stats.failovers
    assert swarm.idle()  # released on every hop
    # in memory, the driver's own watchdog is the only thread a generation starts, and it is joined
    assert {t.name for t in during} == {f"route-{driver.session_id[:8]}:watchdog"}   # its ThreadGroup's
    assert not any(t.is_alive() for t in during)


def test_killed_hop_mid_decode_fails_over_with_identical_tokens(swarm, reference):
    driver = swarm.driver()
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == 7:
            swarm["peer-b"].kill()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and event.position == len(PROMPT) + 7
    hops = driver.stats.routes[-1].hops
    assert [(h.peer_id, h.effective_start) for h in hops] == [("peer-a", 0), ("peer-c", 3)]
    assert event.reprefilled == (1,)
    assert swarm.idle("peer-a", "peer-c")


def test_killed_hop_before_the_first_token_fails_over(swarm, reference):
    swarm["peer-b"].kill()
    driver = swarm.driver()
    assert collect(driver, request()) == reference
    assert driver.stats.failovers[0].failed_peer == "peer-b"


def test_a_hop_refusing_connections_is_routed_around(swarm, reference):
    swarm["peer-b"].hop.refuse()
    driver = swarm.driver()
    assert collect(driver, request()) == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and "connection refused" in event.detail
    assert driver.stats.routes[-1].peers == ("peer-a", "peer-c")


def test_a_bad_frame_from_a_hop_is_its_failure_and_the_tokens_stay_exact(swarm, reference):
    driver = swarm.driver()
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == 3:
            swarm["peer-b"].hop.corrupt()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and "bad response" in event.detail
    assert driver.stats.routes[-1].peers == ("peer-a", "peer-c")
    assert swarm.idle("peer-a", "peer-c")


def test_head_failure_without_replacement_is_a_clear_error(swarm):
    driver = swarm.driver()
    gen = driver.generate(request())
    next(gen)
    swarm["peer-a"].kill()
    with pytest.raises(RouteFailed, match="no route"):
        list(gen)


def test_seeded_sampling_is_reproducible_across_a_failover(swarm):
    spec = SamplingSpec(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    first = collect(swarm.driver(), request(sampling=spec))
    driver = swarm.driver()
    second = []
    for token in driver.generate(request(sampling=spec)):
        second.append(token.id)
        if len(second) == 3:
            swarm["peer-b"].kill()
    assert second == first and driver.stats.failovers


def test_stop_token_ends_early(swarm, reference):
    stop = reference[5]
    tokens = collect(swarm.driver(), request(stop_ids=frozenset({stop})))
    assert tokens == reference[:reference.index(stop) + 1]


def test_cancel_releases_kv_on_every_hop(swarm):
    driver = swarm.driver()
    gen = driver.generate(request())
    next(gen)
    assert swarm["peer-a"].active_sessions() == 1 and swarm["peer-b"].active_sessions() == 1
    canceller = threading.Thread(target=driver.cancel)
    canceller.start()
    canceller.join()
    with pytest.raises(GenerationCancelled):
        list(gen)
    assert swarm.idle()


def test_closing_the_stream_early_releases_kv(swarm):
    gen = swarm.driver().generate(request())
    next(gen)
    gen.close()
    assert swarm.idle()


def test_hop_failure_names_the_hop():
    err = HopFailure(2, "peer-x" * 4, "transport: UNAVAILABLE")
    assert err.index == 2 and "hop 2" in str(err) and "UNAVAILABLE" in str(err)


def test_a_hop_silent_past_its_step_deadline_is_replaced(swarm, reference):
    """B stops answering mid-decode (its transport freezes): its deadline, derived from its own
    decode steps (milliseconds here, so the DECODE_FLOOR_S floor), cuts the call and C takes
    over."""
    from meshd.generate.deadlines import DECODE_FLOOR_S

    driver = swarm.driver()
    tokens, times = [], []
    for token in driver.generate(request()):
        tokens.append(token.id)
        times.append(time.monotonic())
        if len(tokens) == 4:
            swarm["peer-b"].freeze()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and "step deadline" in event.detail
    assert times[4] - times[3] >= DECODE_FLOOR_S     # never cut before its deadline


def test_a_silent_hop_without_replacement_is_retried_with_more_patience(swarm, reference):
    """Only A -> B exists: B silent for a while is cut, then retried on the same peer (fresh
    session, re-prefilled, doubled patience): the generation finishes, same tokens. B is still
    silent when the driver gives up on it (no replacement) and answers a moment later, well
    within the retry's open deadline."""
    swarm["peer-c"].kill()
    b = swarm["peer-b"]
    thawing = threading.Timer(0.5, b.thaw)

    class Source:   # the swarm's A and B; thaws B once the driver looked for a replacement
        inner = swarm.source(lambda: swarm.ads(("peer-a", "peer-b")))

        def plan(self, needed_tokens):
            return self.inner.plan(needed_tokens)

        def replace(self, route, failed_peer, avoid, needed_tokens):
            if not thawing.is_alive() and b.hop.frozen:
                thawing.start()
            return self.inner.replace(route, failed_peer, avoid, needed_tokens)

    driver = swarm.driver(source=Source())
    tokens = []
    try:
        for token in driver.generate(request()):
            tokens.append(token.id)
            if len(tokens) == 4:
                b.freeze()
    finally:
        if thawing.is_alive():
            thawing.join()
    assert tokens == reference
    assert [e.failed_peer for e in driver.stats.failovers] == ["peer-b"]
    assert [h.peer_id for h in driver.stats.routes[-1].hops] == ["peer-a", "peer-b"]


def test_the_tail_sends_only_the_token(swarm, reference):
    from proto.limits import MAX_TAIL_BYTES_PER_DECODE_STEP

    driver = swarm.driver()
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


def test_logits_and_logprobs_only_when_asked(swarm):
    from shard.model.sampling import sample_token, token_logprobs

    spec = SamplingSpec(temperature=0.9, top_k=30, seed=5)
    whole = WholeModel(swarm.model).generate(list(PROMPT), NEW_TOKENS, chunk_tokens=CHUNK)
    driver = swarm.driver()
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
    only_lp = list(swarm.driver().generate(request(sampling=spec, logprobs=True)))
    assert [t.id for t in only_lp] == [t.id for t in tokens]
    assert all(t.logprob is not None and t.top == () for t in only_lp)
    with pytest.raises(LocalError, match="top_logprobs"):
        request(top_logprobs=21)


def test_a_fixed_route_needs_no_swarm(swarm, reference):
    from meshd.generate.routes import discover_fingerprint, fixed_route

    a, b = swarm["peer-a"], swarm["peer-b"]
    assert a.service.validate().validated and b.service.validate().validated
    source = fixed_route([(a.endpoint, 0, 3), (b.endpoint, 3, 6)], NUM_LAYERS)
    connector = swarm.connector()
    fp = discover_fingerprint(connector, source.route)
    assert fp == a.service.backend.fingerprint
    assert collect(SwarmDriver(source, connector, fingerprint=fp), request()) == reference
    asked = []

    class Counted:   # the fixed route, counting the driver's asks for a replacement
        static = True

        def plan(self, needed_tokens):
            return source.plan(needed_tokens)

        def replace(self, *args):
            asked.append(1)
            return source.replace(*args)

    driver = SwarmDriver(Counted(), connector, fingerprint=fp, replan_wait_s=60.0)
    gen = driver.generate(request())
    next(gen)
    b.kill()
    with pytest.raises(RouteFailed, match="no live peer serves layer"):
        list(gen)
    assert asked == [1]                 # no waiting for a swarm that is not there: asked once
    assert a.active_sessions() == 0


def test_a_failover_looks_in_the_cached_snapshot_before_reading_the_dht(swarm, reference):
    """A fresh DHT read can wait seconds on the very peer that froze: the latest snapshot first."""
    fp = swarm.fingerprint
    reads = []

    def ads():
        reads.append(1)
        return swarm.ads()

    source = AdsRouteSource(ads, fp.model_artifact_digest, NUM_LAYERS, entry_peer_id="entry",
                            recipe_digest=fp.runtime_recipe_digest, cached=swarm.ads)
    driver = swarm.driver(source=source)
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == 5:
            swarm["peer-b"].kill()
    assert tokens == reference and len(driver.stats.failovers) == 1
    assert len(reads) == 1                      # the first plan only
