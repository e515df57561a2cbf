"""The route driver's relay failover over shards in memory (real ShardServices, in-memory transports).

A connector that can reach peer-b two ways (two shard servers of the same
range stand for one home node behind two relays) says ``retry_same_peer``
after the first way died: the driver keeps the route, restarts only that hop
(re-prefilled from the kept boundary rows) and the tokens equal the whole
model's. When no way is left the peer is avoided like any failed peer.
"""
from __future__ import annotations

import pytest

from meshd.generate.driver import GenerationRequest, RouteFailed, SwarmDriver, collect
from meshd.generate.routes import FactoryConnector
from tests._swarm_helpers import MemorySwarm, whole_tokens

PROMPT = tuple(range(7, 37))
NEW_TOKENS = 16


class TwoWayConnector(FactoryConnector):
    """Like PeerConnector with a RelayDialer: each peer has a list of ways, the next one after a failure."""

    def __init__(self, swarm: MemorySwarm, ways: dict[str, list[str]]) -> None:
        super().__init__(swarm.network.transport)
        self.ways = ways
        self.used = {p: 0 for p in ways}
        self.retries: list[str] = []

    def transport(self, hop):
        return self.factory(self.ways[hop.peer_id][self.used[hop.peer_id]])

    def retry_same_peer(self, peer_id: str) -> bool:
        if self.used[peer_id] + 1 < len(self.ways[peer_id]):
            self.used[peer_id] += 1
            self.retries.append(peer_id)
            return True
        return False


def test_same_peer_through_another_way_keeps_route_and_tokens_then_gives_up():
    reference = whole_tokens(NEW_TOKENS, PROMPT)
    swarm = MemorySwarm()
    a = swarm.start("peer-a", 0, 3)
    b1 = swarm.start("peer-b", 3, 6)
    b2 = swarm.start("peer-b", 3, 6)   # the same peer, reached the second way
    fp = swarm.fingerprint
    source = swarm.source(lambda: [a.ad(), b1.ad()])
    connector = TwoWayConnector(swarm, {"peer-a": [a.endpoint], "peer-b": [b1.endpoint, b2.endpoint]})
    driver = SwarmDriver(source, connector, fingerprint=fp, replan_wait_s=0.0)
    tokens = []
    for token in driver.generate(GenerationRequest(PROMPT, NEW_TOKENS, chunk_tokens=16)):
        tokens.append(token.id)
        if len(tokens) == 5:
            b1.kill()        # the first way (relay) to peer-b dies mid-decode
    assert tokens == reference
    (event,) = driver.stats.failovers
    assert event.failed_peer == "peer-b" and event.reprefilled == (1,)
    assert event.route.peers == driver.stats.routes[0].peers == ("peer-a", "peer-b")
    assert connector.retries == ["peer-b"]
    assert b2.active_sessions() == 0 and a.active_sessions() == 0   # released at the end

    # No way left: the peer is avoided; with no other server of [3, 6) that is a clear error.
    b2.kill()
    with pytest.raises(RouteFailed):
        collect(SwarmDriver(source, connector, fingerprint=fp, replan_wait_s=0.0),
                GenerationRequest(PROMPT, NEW_TOKENS, chunk_tokens=16))
