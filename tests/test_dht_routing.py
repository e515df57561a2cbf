"""Lookups route: real py-libp2p hosts on loopback, DhtNode's iterative lookups.

Eight hosts in a chain: each joins through the one before it (its bootstrap
peer, then a lookup of its own id, as the daemon does); then the first host
drops every connection and table entry but its neighbour's. A record held by
the last host alone is still found by the first,
which was never connected to it: every answer names the answering peer's
closest peers, and the lookup asks them in turn (dht/lookup.py). A publish
then replicates to the k closest peers a lookup finds -- here every host.
"""
from __future__ import annotations

import time
from contextlib import AsyncExitStack

import trio

from dht import keys as K
from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.node import DhtNode
from dht.records import validate_capability
from tests._daemon_helpers import DIGEST, good, identity
from tests.conftest import wait_until

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEST_TIMEOUT_S = 90
HOSTS = 8


def wall_ms() -> int:
    return int(time.time() * 1000)


def test_a_record_at_the_far_end_of_a_chain_is_found_and_a_publish_reaches_every_host():
    idents = [identity(40 + i) for i in range(HOSTS)]

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with AsyncExitStack() as stack:
                nodes = []
                for ident in idents:
                    host = await stack.enter_async_context(running_host(ident, LOOPBACK))
                    nodes.append(await stack.enter_async_context(DhtNode(host, wall_ms).running()))
                for prev, node in zip(nodes, nodes[1:]):
                    boot = [f"{prev.host.get_addrs()[0]}/p2p/{prev.host.get_id()}"]
                    await connect_bootstrap(node.host, boot, 10)
                    await node.join()                  # as the daemon does: bootstrap, then a self-lookup
                # The chain is complete once every host has its neighbours in its table. An inbound
                # peer is inserted only once identify has stored its addresses, which a loaded machine
                # delays past the joiner's RPCs; the daemon's peer_sync loop adds it later, as here.
                for a, b in zip(nodes, nodes[1:]):
                    while not (a.kad.routing_table.peer_in_table(b.host.get_id())
                               and b.kad.routing_table.peer_in_table(a.host.get_id())):
                        await a.sync_peers()
                        await b.sync_peers()
                        await trio.sleep(0.02)
                first, last = nodes[0], nodes[-1]
                # the first host forgets everyone but its neighbour: it must route to reach the rest
                for peer in list(first.host.get_connected_peers()):
                    if peer != nodes[1].host.get_id():
                        await first.host.get_network().close_peer(peer)
                for peer in first.kad.routing_table.get_peer_ids():
                    if peer != nodes[1].host.get_id():
                        first.kad.routing_table.remove_peer(peer)
                assert last.host.get_id() not in first.host.get_connected_peers()
                assert not first.kad.routing_table.peer_in_table(last.host.get_id())

                raw = good(idents[-1], now=wall_ms(), start=0, end=4)
                last.store_locally(K.peer_key(idents[-1].peer_id), raw)   # held by the last host only
                found = await first.fetch(K.peer_key(idents[-1].peer_id))
                assert [r.peer_id for r in found] == [idents[-1].peer_id]
                assert first.last_lookup.rounds >= 2                      # it took hops, not one ask
                # and it learned the way (inserted in the background)
                await wait_until(lambda: first.kad.routing_table.peer_in_table(last.host.get_id()), TEST_TIMEOUT_S,
                                 "the last host in the first one's routing table")

                record = validate_capability(good(idents[0], now=wall_ms(), seq=12, start=4, end=8), wall_ms())
                acked = await first.publish(record)
                assert acked == 3 * (HOSTS - 1)                           # 3 keys at every other host
                seen = await nodes[-1].fetch(K.span_key(DIGEST, 4, 8))
                assert [r.sequence for r in seen] == [12]

    trio.run(main)
