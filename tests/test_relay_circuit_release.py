"""A relay frees a circuit's slot when the circuit's ends go (real py-libp2p hosts on loopback).

The home node and the client keep their identities across "restarts" (as a daemon does with
its persistent key), so every circuit the relay failed to release would count against the
client's per-source cap (8) and, after 8 cycles, the relay would refuse it. Half the exits
are crashes: the TCP sockets close under the host with no yamux GO_AWAY or stream reset, which
is what the relay sees of a SIGKILLed process; the other half are clean stops.
"""
from __future__ import annotations

import os

import trio
from libp2p.tools.anyio_service import background_trio_service

from dht.host.build import running_host
from dht.identity import Identity
from relay.client import dial_relayed, reserve, stop_service
from relay.hop import CIRCUITS_PER_SOURCE, HopLimits, HopService
from tests._relay_helpers import crash_connections, info
from tests.conftest import wait_until

LISTEN = ["/ip4/127.0.0.1/tcp/0"]
ECHO = "/meshd-test/echo/1"
# More restarts than the per-source cap, so one leaked circuit per cycle would be refused.
CYCLES = CIRCUITS_PER_SOURCE + 4
# Bound on the relay noticing a closed connection on loopback (it happens within milliseconds).
NOTICE_S = 15.0


async def _echo(stream) -> None:
    try:
        while data := await stream.read(65536):
            await stream.write(data)
    finally:
        await stream.close()


def _connected(host, peer) -> bool:
    return bool(host.get_network().connections.get(peer))


def test_circuits_are_released_when_their_ends_exit_again_and_again():
    home_identity = Identity.from_seed(b"h" * 32)
    client_identity = Identity.from_seed(b"c" * 32)

    async def main():
        async with running_host(Identity.from_seed(os.urandom(32)), LISTEN) as relay:
            hop = HopService(relay)
            async with background_trio_service(hop):
                await hop.event_started.wait()
                for cycle in range(CYCLES):
                    crash = cycle % 2 == 0
                    async with running_host(home_identity, LISTEN) as home, stop_service(home):
                        home.set_stream_handler(ECHO, _echo)
                        await reserve(home, info(relay))
                        async with running_host(client_identity, LISTEN) as client:
                            await dial_relayed(client, info(relay), home.get_id())   # RelayRefused fails
                            stream = await client.new_stream(home.get_id(), [ECHO])
                            await stream.write(b"token %d" % cycle)
                            assert await stream.read(64) == b"token %d" % cycle
                            assert hop.snapshot()["circuits_active"] == 1
                            if crash:
                                # the client dies first; the relay notices before the home dies too
                                crash_connections(client)
                                await wait_until(lambda: not _connected(relay, client.get_id()), NOTICE_S,
                                                 "the relay noticing the crashed client")
                        if crash:
                            crash_connections(home)
                    # both ends are gone: the live count is 0, and the relay's must be too
                    await wait_until(lambda: hop.snapshot()["circuits_active"] == 0, NOTICE_S,
                                     f"the relay releasing cycle {cycle}'s circuit")
                snap = hop.snapshot()
                assert snap["circuits_refused"] == {}
                assert snap["circuits_opened"] == CYCLES and snap["circuits_closed"] == CYCLES

    trio.run(main)


def test_a_circuit_silent_past_the_idle_deadline_is_torn_down():
    """Both ends alive, connections open, nothing crosses the circuit: a machine that went to
    sleep looks like this to the relay. The idle deadline ends it (its ends' yamux pings every
    30 s keep a live circuit far from the real 120 s deadline)."""
    async def main():
        async with running_host(Identity.from_seed(os.urandom(32)), LISTEN) as relay:
            hop = HopService(relay, HopLimits(circuit_idle_timeout_s=1.0))
            async with background_trio_service(hop):
                await hop.event_started.wait()
                async with (running_host(Identity.from_seed(os.urandom(32)), LISTEN) as home,
                            stop_service(home),
                            running_host(Identity.from_seed(os.urandom(32)), LISTEN) as client):
                    await reserve(home, info(relay))
                    await dial_relayed(client, info(relay), home.get_id())
                    assert hop.snapshot()["circuits_active"] == 1
                    await wait_until(lambda: hop.snapshot()["circuits_active"] == 0, NOTICE_S,
                                     "the idle circuit's teardown")
                    snap = hop.snapshot()
                    assert snap["circuits_closed"] == 1 and snap["circuits_closed_by"] == {"idle": 1}

    trio.run(main)
