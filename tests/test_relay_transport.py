"""Relayed hops over real libp2p hosts on loopback: frames through a circuit-relay v2 relay."""
from __future__ import annotations

import os

import pytest
import trio

from proto import shard_runtime_pb2 as pb
from relay.client import dial_relayed
from relay.errors import RelayRefused
from relay.transport import RelayedSessionServer, open_session_channel
from tests._relay_helpers import ECHO_PREFIX, echo_worker, info, triangle
from tests.conftest import wait_until


def run(fn, *args):
    trio.run(fn, *args)


def test_frames_travel_through_the_relay_to_the_worker_and_back():
    captured = bytearray()

    async def main():
        with echo_worker() as target:
            async with triangle(tap=captured.extend) as t:
                server = RelayedSessionServer(target)
                server.attach(t.home)
                try:
                    channel = await open_session_channel(t.dialer, t.home.get_id())
                    secret = os.urandom(64) * 64      # 4 KiB a relay would recognise
                    opening = pb.SessionRequest(open=pb.SessionOpen(
                        schema_version=1, route_session_id="s", relayed_peer_id="forged")).SerializeToString()
                    bodies = [opening, secret, b"x" * (1 << 20)]
                    for i, body in enumerate(bodies):
                        await channel.send(body)
                        echoed = await channel.receive()
                        if i == 0:   # the home node stamps the circuit's authenticated peer id
                            stamped = pb.SessionRequest.FromString(echoed[len(ECHO_PREFIX):])
                            assert stamped.open.relayed_peer_id == str(t.dialer.get_id())
                            assert stamped.open.route_session_id == "s"
                        else:
                            assert echoed == ECHO_PREFIX + body
                    await channel.close()
                    assert await channel.receive() is None
                    await wait_until(lambda: not server.active, 5, "the relayed session server idle")
                    assert server.served == 1 and server.budget.in_use == 0
                    snap = t.hop.snapshot()
                    assert snap["circuits_active"] == 1 and snap["reservations_active"] == 1
                    assert snap["bytes_forwarded"] >= 2 * sum(map(len, bodies))
                    # The relay forwarded everything, yet never saw a frame in clear.
                    assert len(captured) == snap["bytes_forwarded"]
                    assert secret[:256] not in captured and b"echo:" not in captured
                finally:
                    server.close()

    run(main)


def test_a_circuit_to_a_peer_without_reservation_is_refused():
    async def main():
        async with triangle(reserve_home=False, connect=False) as t:
            with pytest.raises(RelayRefused) as err:
                await dial_relayed(t.dialer, info(t.relay), t.home.get_id())
            assert err.value.status == "NO_RESERVATION"
            assert t.hop.snapshot()["circuits_refused"] == {"NO_RESERVATION": 1}

    run(main)
