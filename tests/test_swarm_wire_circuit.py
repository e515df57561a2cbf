"""meshd/swarm/wire.py: a directive exchange reaches a peer that has only relayed addresses,
over a real relay circuit (loopback hosts, circuit relay v2)."""
from __future__ import annotations

import trio

from meshd.swarm.wire import DIRECTIVE_PROTOCOL, SwarmUnreachable, exchange, serve
from relay.client import relayed_addrs, reserve
from tests._relay_helpers import info, triangle

TEST_TIMEOUT_S = 60


def test_exchange_dials_a_relayed_only_peer_through_its_circuit():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with triangle(reserve_home=False, connect=False) as t:
                seen = []

                async def handler(remote: str, body: bytes) -> bytes:
                    seen.append(remote)
                    return b"ack:" + body

                serve(t.home, DIRECTIVE_PROTOCOL, handler)
                reservation = await reserve(t.home, info(t.relay))
                circuit = relayed_addrs(reservation, t.home.get_id().to_base58())
                home_id = t.home.get_id().to_base58()
                assert t.home.get_id() not in t.dialer.get_connected_peers()
                reply = await exchange(t.dialer, home_id, (), DIRECTIVE_PROTOCOL, b"load", relayed=circuit)
                assert reply == b"ack:load" and seen == [t.dialer.get_id().to_base58()]
                assert t.hop.snapshot()["circuits_opened"] >= 1
                # a relayed address of another peer is never used for this one
                other = [a.replace(home_id, t.dialer.get_id().to_base58()) for a in circuit]
                for conn in list(t.dialer.get_network().connections.get(t.home.get_id(), [])):
                    await conn.close()
                try:
                    await exchange(t.dialer, home_id, (), DIRECTIVE_PROTOCOL, b"x", relayed=other)
                    raise AssertionError("exchanged through a circuit to someone else")
                except SwarmUnreachable:
                    pass

    trio.run(main)
