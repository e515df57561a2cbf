"""The push topology over shards in memory: exact tokens, counted legs, exact recovery.

A tiny random Llama (6 layers) in four shards: A [0,2), B [2,4), C [4,6) and
D [2,6) (dearer per layer), so the route is A -> B -> C, pushed: the entry
feeds A, A pushes to B, B to C, C answers the token. Killing B mid-decode must
move to A -> D with A re-sending the rows it holds to D (PushRepoint); killing
C must move to A -> B -> D (effective start 4) with B re-sending its rows.
Tokens equal the whole model's, greedy and seeded, with and without failure.
Workers are real ShardServices; the entry and the workers' own pushes reach
each other through in-memory transports (shard/edges/memory.py), whose faults
(a worker killed, frozen, unreachable) stand for a dead, silent or NATed peer.
"""
from __future__ import annotations

import threading
import time

import pytest

from meshd.errors import CertificateMismatch
from meshd.generate.driver import RouteFailed, collect
from meshd.generate.push import PushDriver, PushLink
from meshd.generate.routes import fixed_route
from proto import shard_runtime_pb2 as pb
from proto.frames import parse_response
from shard.edges.memory import MemoryStream
from tests._swarm_helpers import NUM_LAYERS, PROMPT, MemorySwarm, decode_input_of, whole_tokens
from tests._swarm_helpers import request as make_request

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def reference():
    return whole_tokens(NEW_TOKENS)


@pytest.fixture
def swarm():
    swarm = MemorySwarm()
    swarm.start("peer-a", 0, 2)
    swarm.start("peer-b", 2, 4)
    swarm.start("peer-c", 4, 6)
    swarm.start("peer-d", 2, 6, cost=5.0)
    return swarm


def request(**kw):
    return make_request(NEW_TOKENS, **kw)


def pushed(swarm, **kw) -> PushDriver:
    return swarm.driver("push", **kw)


LOOPS = pytest.mark.parametrize("loop", [True, False], ids=["looped", "entry-fed"])


@LOOPS
def test_pushed_tokens_equal_the_whole_model_with_hops_plus_one_legs(swarm, reference, loop):
    driver = pushed(swarm, loop=loop)
    assert collect(driver, request()) == reference
    assert driver.stats.routes[0].peers == ("peer-a", "peer-b", "peer-c")
    assert not driver.stats.failovers
    assert driver.stats.step_legs and set(driver.stats.step_legs) == {3 + 1}   # counted by the hops
    if loop:   # the tail sent every token but the last straight to the head: the entry fed only the prompt
        assert driver.looped and driver.stats.looped_steps == NEW_TOKENS - 1 and driver.stats.continued_steps == 0
    else:      # decode inputs after the first go to the head from the tail's reader thread (the
        # continuation) when it beats the driver thread -- a race between two threads, so the count is
        # bounded, not exact: the driver sends what the continuation did not (the tokens prove it)
        assert not driver.looped and 0 < driver.stats.continued_steps <= NEW_TOKENS - 2
    assert swarm.idle()                                   # released everywhere
    assert swarm.no_pushed_sessions()


@LOOPS
def test_inputs_sent_ahead_stop_at_a_stop_id_and_at_the_last_token(swarm, reference, loop):
    stop_at = 7                      # the 8th generated token is a stop id: the generation ends there
    assert reference[stop_at] not in reference[:stop_at]
    driver = pushed(swarm, loop=loop)
    tokens = collect(driver, request(stop_ids=frozenset({reference[stop_at]})))
    assert tokens == reference[:stop_at + 1]
    if loop:   # looped: tokens 1..7 went to the head, never the stop token
        assert driver.stats.looped_steps == stop_at
    else:      # sent ahead by the continuation (when it beats the driver thread): after tokens 2..7 at most
        assert 0 < driver.stats.continued_steps <= stop_at - 1
    assert swarm.idle()


def test_star_still_runs_and_counts_two_legs_per_hop(swarm, reference):
    driver = swarm.driver("star-push")
    assert collect(driver, request()) == reference
    assert set(driver.stats.step_legs) == {2 * 3}


@LOOPS
def test_killed_middle_hop_mid_decode_recovers_from_rows_held_upstream(swarm, reference, loop):
    # B dies as the step carrying the 7th token reaches it: with the next step already in flight
    # when the entry sees a token, only the transport can place the death exactly
    swarm["peer-b"].hop.kill_on(decode_input_of(7))
    driver = pushed(swarm, loop=loop)
    tokens = collect(driver, request())
    assert tokens == reference
    (event,) = driver.stats.failovers
    # the entry notices B's death while it awaits the token B's step carried or, when its reader had
    # not yet handed over the one before (two threads of the in-memory transport), that one
    assert event.failed_peer == "peer-b" and event.position in (len(PROMPT) + 6, len(PROMPT) + 7)
    hops = driver.stats.routes[-1].hops
    assert [(h.peer_id, h.effective_start) for h in hops] == [("peer-a", 0), ("peer-d", 2)]
    assert event.reprefilled == (1,)          # the head kept its KV: only D was re-prefilled (from A's rows)
    assert set(driver.stats.step_legs[-3:]) == {2 + 1}
    assert swarm.idle("peer-a", "peer-d")


@LOOPS
def test_killed_tail_mid_decode_recovers_from_the_middle_hops_rows(swarm, reference, loop):
    driver = pushed(swarm, loop=loop)
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == 4:
            swarm["peer-c"].kill()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-c"
    hops = driver.stats.routes[-1].hops
    assert [(h.peer_id, h.effective_start) for h in hops] == [("peer-a", 0), ("peer-b", 2), ("peer-d", 4)]
    assert event.reprefilled == (2,)


@LOOPS
def test_seeded_sampling_is_identical_across_a_pushed_failover(swarm, loop):
    from shard.model.sampling import SamplingSpec

    spec = SamplingSpec(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    first = collect(pushed(swarm, loop=loop), request(sampling=spec))
    assert first == collect(swarm.driver("star-push"), request(sampling=spec))
    driver = pushed(swarm, loop=loop)
    second = []
    for token in driver.generate(request(sampling=spec)):
        second.append(token.id)
        if len(second) == 5:
            swarm["peer-b"].kill()
    assert second == first and driver.stats.failovers


def test_logprobs_travel_back_from_a_pushed_tail(swarm):
    star_tokens = list(swarm.driver("star-push").generate(request(logprobs=True, top_logprobs=3)))
    tokens = list(pushed(swarm).generate(request(logprobs=True, top_logprobs=3)))
    assert [t.id for t in tokens] == [t.id for t in star_tokens]
    assert all(p.logprob == s.logprob and p.top == s.top for p, s in zip(tokens, star_tokens))


@pytest.mark.parametrize("kill_at", [1, 6])
def test_a_killed_head_of_a_loop_is_replaced_and_fed_its_history_by_the_entry(swarm, reference, kill_at):
    """E, a dearer replica of the head A, takes over when A dies: every hop is fresh, the entry feeds
    E the prompt and every token so far, and the new tail loops its tokens to E from there on."""
    swarm.start("peer-e", 0, 2, cost=5.0)
    driver = pushed(swarm)
    tokens = []
    for token in driver.generate(request()):
        tokens.append(token.id)
        if len(tokens) == kill_at:
            swarm["peer-a"].kill()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-a" and driver.looped
    assert driver.stats.routes[-1].peers[0] == "peer-e"
    assert driver.stats.looped_steps >= NEW_TOKENS - kill_at - 1


def test_killed_head_without_replacement_is_a_clear_error(swarm):
    driver = pushed(swarm)
    gen = driver.generate(request())
    next(gen)
    swarm["peer-a"].kill()
    with pytest.raises(RouteFailed, match="no route"):
        list(gen)


def test_a_worker_without_a_dialer_refuses_to_push(reference):
    swarm = MemorySwarm()
    a, b = swarm.start("a", 0, 3, push=False), swarm.start("b", 3, 6, push=False)
    source = fixed_route([(a.endpoint, 0, 3), (b.endpoint, 3, 6)], NUM_LAYERS)
    driver = PushDriver(source, swarm.connector(), fingerprint=swarm.fingerprint, replan_wait_s=0.0)
    with pytest.raises(RouteFailed, match="cannot push"):
        collect(driver, request())
    assert swarm.idle()


def test_a_silent_middle_hop_is_found_by_the_route_deadline_and_replaced(swarm, reference):
    """B stops answering mid-decode (its transport freezes): nothing fails, so the route's step
    deadline passes; B is the hop that does not answer Health, and D takes over from A's rows."""
    from meshd.generate.deadlines import DECODE_FLOOR_S

    driver = pushed(swarm)
    tokens, times = [], []
    for token in driver.generate(request()):
        tokens.append(token.id)
        times.append(time.monotonic())
        if len(tokens) == 4:
            swarm["peer-b"].freeze()
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and "Health" in event.detail
    # the stall is never shorter than the deadline's floor (a step already past B when it froze may
    # still arrive first: a pushed route has the next token in flight)
    assert max(b - a for a, b in zip(times[3:], times[4:])) >= DECODE_FLOOR_S
    assert threading.active_count() < 200   # reader threads end with their streams


def _feed_attempt(shard, session_id: str, fp, token: bytes) -> pb.SessionResponse:
    """Open a push_feed stream on ``shard`` for the session, as an upstream hop would."""
    stream = MemoryStream(shard.hop)
    stream.send(pb.SessionRequest(open=pb.SessionOpen(
        schema_version=1, route_session_id=session_id, route_epoch=0, fingerprint=fp,
        shard_range=pb.ShardRange(start_layer=2, end_layer=4, effective_start_layer=2), push_feed=True,
        max_tokens=64, owner_token=token)).SerializeToString())
    try:
        body = stream.receive()
    finally:
        stream.cancel()
    if body is None:
        raise AssertionError("no answer to the feed attempt")
    return parse_response(body)


def test_only_the_named_upstream_hop_may_feed_a_pushed_session(swarm, reference):
    """A stranger that knows the session id and epoch cannot attach as B's feeder; the generation goes on."""
    driver = pushed(swarm)
    stream = driver.generate(request())
    tokens = [next(stream).id]
    resp = _feed_attempt(swarm["peer-b"], driver.session_id, swarm.fingerprint, b"s" * 32)
    assert resp.WhichOneof("kind") == "status" and resp.status.error.code == pb.ERROR_CODE_PERMISSION_DENIED
    tokens += [t.id for t in stream]
    assert tokens == reference and not driver.stats.failovers


def _unreachable_from(swarm, dialing: str, target_peer: str, why: str) -> None:
    """``dialing``'s pushes to ``target_peer`` fail as a dial through a NAT (or to a dead host) does."""
    network = swarm.network

    def dial(target: pb.PushTarget):
        if target.peer_id == target_peer:
            raise CertificateMismatch(why)
        return network.dial(target)

    swarm[dialing].service.push_dialer = dial


def test_a_tail_that_cannot_reach_the_head_turns_the_loop_off(swarm, reference):
    """C cannot dial A (a head behind a NAT nobody detected): C reports it, the entry restarts the same
    route entry-fed (A is not blamed) and the tokens are the same."""
    _unreachable_from(swarm, "peer-c", "peer-a", "unreachable from here")
    driver = pushed(swarm)
    assert collect(driver, request()) == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-a" and "loop is off" in event.detail
    assert not driver.looped and driver.stats.routes[-1].peers == ("peer-a", "peer-b", "peer-c")
    assert driver.stats.continued_steps > 0
    assert swarm.idle()


def test_a_tail_that_cannot_reach_a_dead_head_fails_over_and_keeps_the_loop(swarm, reference, monkeypatch):
    """The race in which the tail's report that it cannot reach the head arrives before the head's own
    stream breaks: the entry asks the head for Health, and a silent head is replaced like any failed
    hop (E takes over, the loop stays on) -- not mistaken for a head the tail merely cannot dial.
    A dead head whose stream has not broken yet cannot be caused on demand: its Health is mocked."""
    swarm.start("peer-e", 0, 2, cost=5.0)
    _unreachable_from(swarm, "peer-c", "peer-a", "peer-a is gone")
    real_probe = PushLink.probe
    monkeypatch.setattr(PushLink, "probe", lambda link: link.spec.peer_id != "peer-a" and real_probe(link))
    driver = pushed(swarm)
    assert collect(driver, request()) == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-a" and "not answering Health" in event.detail
    assert driver.looped and driver.stats.routes[-1].peers == ("peer-e", "peer-b", "peer-c")
