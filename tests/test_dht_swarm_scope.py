"""Swarms stay apart in the DHT even when their nodes are connected (dht/host/swarm_scope.py, dht/node.py).

Real py-libp2p hosts on loopback: two nodes of swarm "blue", one of swarm
"red" serving the same model (so that merged views would show at once), and
a plain libp2p host running the library's own KadDHT on /ipfs/kad/1.0.0 (an
IPFS node found on the LAN). Everyone is connected to everyone -- as a
mistaken --bootstrap or a shared relay would do -- and still: only same-swarm
peers enter a routing table, a publish reaches only its swarm, a read sees
only its swarm's records, and the daemon's bootstrap check names the
foreign peer.
"""
from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.common import PROTOCOL_ID as IPFS_DHT
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service

from dht import keys as K
from dht import rpc
from dht.host.build import running_host
from dht.host.swarm_scope import SwarmScope
from dht.node import DhtNode
from dht.records import validate_capability
from meshd.daemon.node import _warn_foreign_bootstrap
from tests._daemon_helpers import DIGEST, good, identity

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEST_TIMEOUT_S = 60
BLUE, RED = SwarmScope("blue"), SwarmScope("red")


def wall_ms() -> int:
    return int(time.time() * 1000)


def test_connected_nodes_of_two_swarms_and_an_ipfs_node_never_share_a_record():
    idents = [identity(70 + i) for i in range(4)]

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                hosts = [await stack.enter_async_context(running_host(i, LOOPBACK)) for i in idents]
                a1, a2, r1 = [await stack.enter_async_context(DhtNode(h, wall_ms, s).running())
                              for h, s in zip(hosts, (BLUE, BLUE, RED))]
                ipfs = KadDHT(hosts[3], DHTMode.SERVER)          # the library as it is: /ipfs/kad/1.0.0
                await stack.enter_async_context(background_trio_service(ipfs))
                for i, h in enumerate(hosts):
                    for other in hosts[i + 1:]:
                        await h.connect(PeerInfo(other.get_id(), other.get_addrs()))
                ids = [h.get_id() for h in hosts]
                while not (a1.kad.routing_table.peer_in_table(ids[1]) and a2.kad.routing_table.peer_in_table(ids[0])):
                    for node in (a1, a2, r1):
                        await node.sync_peers()
                    await trio.sleep(0.02)
                for node in (a1, a2, r1):
                    await node.sync_peers()
                assert set(a1.kad.routing_table.get_peer_ids()) == {ids[1]}
                assert set(a2.kad.routing_table.get_peer_ids()) == {ids[0]}
                assert r1.kad.routing_table.get_peer_ids() == []
                assert set(a1.foreign_peers()) == {ids[2].to_base58(), ids[3].to_base58()}
                assert set(r1.foreign_peers()) == {ids[0].to_base58(), ids[1].to_base58(), ids[3].to_base58()}
                assert a1.foreign_seen == 2                      # each logged once, not every sync

                # the same model served in both swarms: a merged view would show both ranges
                blue = validate_capability(good(idents[1], now=wall_ms(), start=0, end=4), wall_ms())
                red = validate_capability(good(idents[2], now=wall_ms(), start=4, end=8), wall_ms())
                assert await a2.publish(blue) == 3                 # 3 keys, acked by a1 alone
                assert await r1.publish(red) == 0                  # nobody of its swarm to store it
                assert [r.peer_id for r in await a1.fetch(K.model_key(DIGEST))] == [idents[1].peer_id]
                assert [r.peer_id for r in await r1.fetch(K.model_key(DIGEST))] == [idents[2].peer_id]
                assert await a1.fetch(K.span_key(DIGEST, 4, 8)) == []

                # the wire refuses: red's protocol at a blue node, the IPFS DHT at any meshd node
                with pytest.raises(Exception):  # noqa: B017 - the library's negotiation error types vary
                    await rpc.get_value(r1.host, ids[0], K.model_key(DIGEST).encode(), protocol=r1.protocol)
                for target in ids[:3]:
                    with pytest.raises(Exception):  # noqa: B017 - same
                        await hosts[3].new_stream(target, [TProtocol(IPFS_DHT)])
                assert not a1.kad.routing_table.peer_in_table(ids[2])   # red's tries put it in no table

                lines: list[str] = []
                await _warn_foreign_bootstrap(a1, [ids[1].to_base58()], "blue", lines.append)   # same swarm
                assert lines == []
                await _warn_foreign_bootstrap(r1, [ids[0].to_base58()], "red", lines.append)
                assert len(lines) == 1 and ids[0].to_base58() in lines[0] and "--swarm" in lines[0], lines

    trio.run(main)
