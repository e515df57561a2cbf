"""The push topology over real in-process gRPC shards: exact tokens, counted legs, exact recovery.

A tiny random Llama (6 layers) in four shards: A [0,2), B [2,4), C [4,6) and
D [2,6) (dearer per layer), so the route is A -> B -> C, pushed: the entry
feeds A, A pushes to B, B to C, C answers the token. Killing B mid-decode must
move to A -> D with A re-sending the rows it holds to D (PushRepoint); killing
C must move to A -> B -> D (effective start 4) with B re-sending its rows.
Tokens equal the whole model's, greedy and seeded, with and without failure.
"""
from __future__ import annotations

import pytest

from meshd.generate.driver import GenerationRequest, RouteFailed, collect
from meshd.generate.push import PushDriver
from meshd.generate.routes import AdsRouteSource, PeerConnector, fixed_route
from meshd.reach.tls import loopback_channel
from proto import shard_runtime_pb2 as pb
from shard.edges.grpc_server import GRPC_OPTIONS
from shard.model.reference import WholeModel
from shard.model.sampling import SamplingSpec
from tests._swarm_helpers import start_shard

NUM_LAYERS = 6
PROMPT = tuple(range(5, 45))  # 40 tokens: three prefill chunks of 16
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def reference(model):
    return WholeModel(model).generate(list(PROMPT), NEW_TOKENS, chunk_tokens=16).tokens


def _loopback_dialer(target: pb.PushTarget):
    return loopback_channel(target.endpoint, GRPC_OPTIONS)


@pytest.fixture
def shards(model):
    made = [start_shard(model, "peer-a", 0, 2), start_shard(model, "peer-b", 2, 4),
            start_shard(model, "peer-c", 4, 6), start_shard(model, "peer-d", 2, 6)]
    for s in made:
        s.service.push_dialer = _loopback_dialer
    yield {s.peer_id: s for s in made}
    for s in made:
        s.kill()


def driver_for(shards, topology="push", **kw) -> PushDriver:
    costs = {"peer-a": 1.0, "peer-b": 1.0, "peer-c": 1.0, "peer-d": 5.0, "peer-e": 5.0}
    fp = next(iter(shards.values())).service.backend.fingerprint
    source = AdsRouteSource(lambda: [s.ad(NUM_LAYERS, costs[p]) for p, s in shards.items()],
                            fp.model_artifact_digest, NUM_LAYERS, entry_peer_id="entry",
                            recipe_digest=fp.runtime_recipe_digest)
    return PushDriver(source, PeerConnector(insecure_loopback=True), fingerprint=fp, replan_wait_s=0.0,
                      topology=topology, **kw)


def request(**kw) -> GenerationRequest:
    return GenerationRequest(PROMPT, NEW_TOKENS, chunk_tokens=16, **kw)


LOOPS = pytest.mark.parametrize("loop", [True, False], ids=["looped", "entry-fed"])


@LOOPS
def test_pushed_tokens_equal_the_whole_model_with_hops_plus_one_legs(shards, reference, loop):
    driver = driver_for(shards, loop=loop)
    assert collect(driver, request()) == reference
    assert driver.stats.routes[0].peers == ("peer-a", "peer-b", "peer-c")
    assert not driver.stats.failovers
    assert driver.stats.step_legs and set(driver.stats.step_legs) == {3 + 1}   # counted by the hops
    if loop:   # the tail sent every token but the last straight to the head: the entry fed only the prompt
        assert driver.looped and driver.stats.looped_steps == NEW_TOKENS - 1 and driver.stats.continued_steps == 0
    else:      # every decode input after the first went to the head from the tail's reader thread (the
        # continuation), before the driver thread woke up: the first follows the prompt's chunk
        assert not driver.looped and driver.stats.continued_steps == NEW_TOKENS - 2
    assert all(s.active_sessions() == 0 for s in shards.values())             # released everywhere
    assert all(not s.service.push_hub._sessions for s in shards.values() if s.service.push_hub)


@LOOPS
def test_inputs_sent_ahead_stop_at_a_stop_id_and_at_the_last_token(shards, reference, loop):
    stop_at = 7                      # the 8th generated token is a stop id: the generation ends there
    assert reference[stop_at] not in reference[:stop_at]
    driver = driver_for(shards, loop=loop)
    tokens = collect(driver, request(stop_ids=frozenset({reference[stop_at]})))
    assert tokens == reference[:stop_at + 1]
    if loop:   # looped: tokens 1..7 went to the head, never the stop token
        assert driver.stats.looped_steps == stop_at
    else:      # sent ahead by the continuation: after tokens 2..7
        assert driver.stats.continued_steps == stop_at - 1
    assert all(s.active_sessions() == 0 for s in shards.values())


def test_star_still_runs_and_counts_two_legs_per_hop(shards, reference):
    driver = driver_for(shards, topology="star")
    assert collect(driver, request()) == reference
    assert set(driver.stats.step_legs) == {2 * 3}


@LOOPS
def test_killed_middle_hop_mid_decode_recovers_from_rows_held_upstream(shards, reference, loop):
    driver = driver_for(shards, loop=loop)
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == 7:
            shards["peer-b"].kill()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and event.position == len(PROMPT) + 7
    hops = driver.stats.routes[-1].hops
    assert [(h.peer_id, h.effective_start) for h in hops] == [("peer-a", 0), ("peer-d", 2)]
    assert event.reprefilled == (1,)          # the head kept its KV: only D was re-prefilled (from A's rows)
    assert set(driver.stats.step_legs[-3:]) == {2 + 1}
    assert shards["peer-a"].active_sessions() == 0 and shards["peer-d"].active_sessions() == 0


@LOOPS
def test_killed_tail_mid_decode_recovers_from_the_middle_hops_rows(shards, reference, loop):
    driver = driver_for(shards, loop=loop)
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == 4:
            shards["peer-c"].kill()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-c"
    hops = driver.stats.routes[-1].hops
    assert [(h.peer_id, h.effective_start) for h in hops] == [("peer-a", 0), ("peer-b", 2), ("peer-d", 4)]
    assert event.reprefilled == (2,)


@LOOPS
def test_seeded_sampling_is_identical_across_a_pushed_failover(shards, loop):
    spec = SamplingSpec(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    first = collect(driver_for(shards, loop=loop), request(sampling=spec))
    assert first == collect(driver_for(shards, topology="star"), request(sampling=spec))
    driver = driver_for(shards, loop=loop)
    second = []
    for token in driver.generate(request(sampling=spec)):
        second.append(token.id)
        if len(second) == 5:
            shards["peer-b"].kill()
    assert second == first and driver.stats.failovers


def test_logprobs_travel_back_from_a_pushed_tail(shards):
    star_tokens = list(driver_for(shards, topology="star").generate(request(logprobs=True, top_logprobs=3)))
    pushed = list(driver_for(shards).generate(request(logprobs=True, top_logprobs=3)))
    assert [t.id for t in pushed] == [t.id for t in star_tokens]
    assert all(p.logprob == s.logprob and p.top == s.top for p, s in zip(pushed, star_tokens))


@pytest.mark.parametrize("kill_at", [1, 6])
def test_a_killed_head_of_a_loop_is_replaced_and_fed_its_history_by_the_entry(model, shards, reference, kill_at):
    """E, a dearer replica of the head A, takes over when A dies: every hop is fresh, the entry feeds
    E the prompt and every token so far, and the new tail loops its tokens to E from there on."""
    spare = start_shard(model, "peer-e", 0, 2)
    spare.service.push_dialer = _loopback_dialer
    shards["peer-e"] = spare
    driver = driver_for(shards)
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == kill_at:
            shards["peer-a"].kill()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-a" and driver.looped
    assert driver.stats.routes[-1].peers[0] == "peer-e"
    assert driver.stats.looped_steps >= NEW_TOKENS - kill_at - 1


def test_killed_head_without_replacement_is_a_clear_error(shards):
    driver = driver_for(shards)
    gen = driver.generate(request())
    next(gen)
    shards["peer-a"].kill()
    with pytest.raises(RouteFailed, match="no route"):
        list(gen)


def test_a_worker_without_a_dialer_refuses_to_push(model, reference):
    made = [start_shard(model, "a", 0, 3), start_shard(model, "b", 3, 6)]
    try:
        fp = made[0].service.backend.fingerprint
        source = fixed_route([(made[0].endpoint, 0, 3), (made[1].endpoint, 3, 6)], NUM_LAYERS)
        driver = PushDriver(source, PeerConnector(insecure_loopback=True), fingerprint=fp, replan_wait_s=0.0)
        with pytest.raises(RouteFailed, match="cannot push"):
            collect(driver, request())
        assert all(s.active_sessions() == 0 for s in made)
    finally:
        for s in made:
            s.kill()


def test_a_silent_middle_hop_is_found_by_the_route_deadline_and_replaced(shards, reference):
    """B stops answering mid-decode (its session lock is held): nothing fails, so the route's step
    deadline passes; B is the hop that does not answer Health, and D takes over from A's rows."""
    import threading
    import time

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
    assert event.failed_peer == "peer-b" and "Health" in event.detail
    assert times[4] - times[3] >= DECODE_FLOOR_S
    assert threading.active_count() < 200   # reader threads end with their streams


def _feed_attempt(shard, session_id: str, fp, token: bytes) -> pb.SessionResponse:
    """Open a push_feed stream on ``shard`` for the session, as an upstream hop would."""
    from proto.frames import parse_response
    from shard.push.successor import SESSION_METHOD

    body = pb.SessionRequest(open=pb.SessionOpen(
        schema_version=1, route_session_id=session_id, route_epoch=0, fingerprint=fp,
        shard_range=pb.ShardRange(start_layer=2, end_layer=4, effective_start_layer=2), push_feed=True,
        max_tokens=64, owner_token=token)).SerializeToString()
    with loopback_channel(shard.endpoint, GRPC_OPTIONS) as channel:
        call = channel.stream_stream(SESSION_METHOD, request_serializer=None, response_deserializer=None)
        for raw in call(iter([body]), timeout=30):
            return parse_response(raw)
    raise AssertionError("no answer to the feed attempt")


def test_only_the_named_upstream_hop_may_feed_a_pushed_session(shards, reference):
    """A stranger that knows the session id and epoch cannot attach as B's feeder; the generation goes on."""
    driver = driver_for(shards)
    fp = shards["peer-b"].service.backend.fingerprint
    stream = driver.generate(request())
    tokens = [next(stream).id]
    resp = _feed_attempt(shards["peer-b"], driver.session_id, fp, b"s" * 32)
    assert resp.WhichOneof("kind") == "status" and resp.status.error.code == pb.ERROR_CODE_PERMISSION_DENIED
    tokens += [t.id for t in stream]
    assert tokens == reference and not driver.stats.failovers


def test_a_tail_that_cannot_reach_the_head_turns_the_loop_off(shards, reference):
    """C cannot dial A (a head behind a NAT nobody detected): C reports it, the entry restarts the same
    route entry-fed (A is not blamed) and the tokens are the same."""
    from meshd.errors import CertificateMismatch

    def no_way_back(target: pb.PushTarget):
        if target.peer_id == "peer-a":
            raise CertificateMismatch("unreachable from here")
        return _loopback_dialer(target)

    shards["peer-c"].service.push_dialer = no_way_back
    driver = driver_for(shards)
    assert collect(driver, request()) == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-a" and "loop is off" in event.detail
    assert not driver.looped and driver.stats.routes[-1].peers == ("peer-a", "peer-b", "peer-c")
    assert driver.stats.continued_steps > 0
    assert all(s.active_sessions() == 0 for s in shards.values())


def test_a_tail_that_cannot_reach_a_dead_head_fails_over_and_keeps_the_loop(model, shards, reference, monkeypatch):
    """The race in which the tail's report that it cannot reach the head arrives before the head's own
    stream breaks: the entry asks the head for Health, and a silent head is replaced like any failed
    hop (E takes over, the loop stays on) -- not mistaken for a head the tail merely cannot dial.
    A dead head whose stream has not broken yet cannot be caused on demand: its Health is mocked."""
    from meshd.errors import CertificateMismatch
    from meshd.generate.push import PushLink

    spare = start_shard(model, "peer-e", 0, 2)
    spare.service.push_dialer = _loopback_dialer
    shards["peer-e"] = spare

    def no_way_back(target: pb.PushTarget):
        if target.peer_id == "peer-a":
            raise CertificateMismatch("peer-a is gone")
        return _loopback_dialer(target)

    shards["peer-c"].service.push_dialer = no_way_back
    real_probe = PushLink.probe
    monkeypatch.setattr(PushLink, "probe",
                        lambda link: link.spec.peer_id != "peer-a" and real_probe(link))
    driver = driver_for(shards)
    assert collect(driver, request()) == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-a" and "not answering Health" in event.detail
    assert driver.looped and driver.stats.routes[-1].peers == ("peer-e", "peer-b", "peer-c")
