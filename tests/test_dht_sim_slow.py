"""A small real-host DHT: 10 py-libp2p hosts with meshd's DhtNode, churn, republish.

The deterministic 1,000-node simulation (tests/test_dht_sim.py) checks the
DHT's logic on a virtual clock; this checks the same core over real hosts
on loopback, in one trio process: every host joins through the first,
publishes one signed record (one of MODELS models) and reads every model;
then a fifth of the hosts stop at once, every survivor republishes (up to
REPUBLISHES times, as the advertiser would every ttl / 3) until each holds
every survivor's record, and every survivor reads again.

Every verdict holds whatever the machine's load: with at most k + 1 hosts
(k = 20) the k closest peers of every key are all the other live hosts, so
a publish puts its record on every other host and a read asks every host
(the publisher included, which holds its own record); the deadlines are
generous (DEADLINE_S: a loaded machine answers a loopback RPC within
seconds), so a late answer is not a lost one; the round bound is the
simulation's, ceil(log2 N) + 2, where a lookup that knows every host takes
two rounds (alpha asks, then the rest at once) and one more per round of
peers late or gone.
"""
from __future__ import annotations

import math
import time
from contextlib import AsyncExitStack

import pytest
import trio

from dht import keys as K
from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.identity import Identity
from dht.kademlia.book import RpcTimer
from dht.kademlia.values import lenient
from dht.node import DhtNode
from dht.records import CapabilityClaim, sign_capability, validate_capability

pytestmark = pytest.mark.slow

HOSTS = 10
STOPPED = HOSTS // 5
MODELS = 3
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# A loopback RPC answers in milliseconds, in seconds on a starved machine: never in this.
DEADLINE_S = 30.0
# A record outlives two failed republishes (ttl / 3 apart): the survivors' records must be
# everywhere within this many. On a starved machine a PUT can still fail below meshd's
# deadlines (py-libp2p negotiates a new stream within its own 10 s, then resets it).
REPUBLISHES = 3
TTL_MS = 600_000
TEST_TIMEOUT_S = 110
ROUND_BOUND = math.ceil(math.log2(HOSTS)) + 2


def wall_ms() -> int:
    return int(time.time() * 1000)


def digest(model: int) -> str:
    return "sha256:" + f"{model + 1:064x}"


def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([200, i]) * 16)


def signed_record(i: int, sequence: int, host):
    claim = CapabilityClaim(model_artifact_digest=digest(i % MODELS), runtime_recipe_digest=digest(i % MODELS),
                            start_layer=0, end_layer=1, num_layers=4, direct_addrs=(str(host.get_addrs()[0]),))
    raw = sign_capability(claim, ident(i).signing_key, peer_id=ident(i).peer_id, sequence=sequence,
                          now_ms=wall_ms(), ttl_ms=TTL_MS)
    return validate_capability(raw, wall_ms())


def expected(alive: list[int]) -> dict[int, set[str]]:
    return {m: {ident(i).peer_id for i in alive if i % MODELS == m} for m in range(MODELS)}


def republished(node: DhtNode, model: int) -> set[str]:
    """The peers whose republished record (sequence 2 or later) ``node`` holds under the model's key."""
    key = K.model_key(digest(model))
    stored = node.store.get(key.encode())
    records = lenient(K.parse_key(key), stored.value, wall_ms()) if stored is not None else []
    return {r.peer_id for r in records if r.sequence > 1}


async def read_all(nodes: dict[int, DhtNode]) -> tuple[dict[tuple[int, int], dict[str, int]], int]:
    """Every node's fetch of every model key: (reader, model) -> {peer id: sequence}; the most rounds."""
    views: dict[tuple[int, int], dict[str, int]] = {}
    rounds = [0]

    async def read(i: int, m: int) -> None:
        node = nodes[i]
        records = await node.fetch(K.model_key(digest(m)))
        views[(i, m)] = {r.peer_id: r.sequence for r in records}
        rounds[0] = max(rounds[0], node.last_lookup.rounds)

    async with trio.open_nursery() as nursery:
        for i in nodes:
            for m in range(MODELS):
                nursery.start_soon(read, i, m)
    return views, rounds[0]


def test_ten_hosts_find_every_record_and_hold_every_survivors_record_after_churn_and_republish():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as everything:
                stacks, nodes = {}, {}
                for i in range(HOSTS):
                    stacks[i] = await everything.enter_async_context(AsyncExitStack())
                    host = await stacks[i].enter_async_context(running_host(ident(i), LOOPBACK))
                    node = await stacks[i].enter_async_context(DhtNode(host, wall_ms).running())
                    node.rpc_timer = RpcTimer(DEADLINE_S, DEADLINE_S, 2 * DEADLINE_S)
                    node.book.dialed = RpcTimer(DEADLINE_S, DEADLINE_S, 2 * DEADLINE_S)
                    nodes[i] = node
                boot = [f"{nodes[0].host.get_addrs()[0]}/p2p/{nodes[0].host.get_id()}"]
                for i in range(1, HOSTS):
                    await connect_bootstrap(nodes[i].host, boot, DEADLINE_S)
                    await nodes[i].join()

                async with trio.open_nursery() as nursery:
                    for i, node in nodes.items():
                        nursery.start_soon(node.publish, signed_record(i, 1, node.host))
                views, rounds = await read_all(nodes)
                want = expected(list(nodes))
                assert {key: set(view) for key, view in views.items()} == \
                    {(i, m): want[m] for i in nodes for m in range(MODELS)}
                assert rounds <= ROUND_BOUND

                # a fifth of the hosts leave at once: the last ones started, innermost first (their
                # nurseries nest in the order the hosts started)
                for i in reversed(range(HOSTS - STOPPED, HOSTS)):
                    await stacks[i].aclose()
                    del nodes[i]
                want = expected(list(nodes))
                for sequence in range(2, 2 + REPUBLISHES):     # every survivor republishes, as the
                    async with trio.open_nursery() as nursery:   # advertiser does every ttl / 3
                        for i, node in nodes.items():
                            nursery.start_soon(node.publish, signed_record(i, sequence, node.host))
                    if all(republished(node, m) == want[m] for node in nodes.values() for m in range(MODELS)):
                        break
                for i, node in nodes.items():              # every survivor holds every survivor's record
                    for m in range(MODELS):
                        assert republished(node, m) == want[m], (i, m, sequence)
                views, rounds = await read_all(nodes)
                for (i, m), view in views.items():
                    assert {p for p, seq in view.items() if seq > 1} == want[m], (i, m)
                assert rounds <= ROUND_BOUND

    trio.run(main)
