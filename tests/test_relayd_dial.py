"""Entry-side relayed hops (meshd/reach/relay_dial.py) with real libp2p hosts on loopback:
two relays, a home node reserved on both that serves an echo worker (its Unix frame socket), and a
dialer whose RelayDialer is driven from a plain thread through the daemon-style Portal."""
from __future__ import annotations

import pytest
import trio
from libp2p.tools.anyio_service import background_trio_service

from meshd.errors import HopFailure
from meshd.generate.routes import PeerConnector
from meshd.plan.routing import Hop
from meshd.reach.relay_dial import RelayDialer
from relay.client import relayed_addrs, reserve, stop_service
from relay.hop import DEFAULT_HOP_LIMITS, HopService
from relay.portal import Portal
from relay.transport import RelayedSessionServer
from tests._relay_helpers import ECHO_PREFIX, LOOPBACK, echo_once, echo_worker, info, new_host

TEST_TIMEOUT_S = 60


async def run_relay(task_status=trio.TASK_STATUS_IGNORED):
    host = new_host()
    async with host.run(LOOPBACK):
        hop = HopService(host, DEFAULT_HOP_LIMITS)
        async with background_trio_service(hop):
            await hop.event_started.wait()
            task_status.started(host)
            await trio.sleep_forever()


def test_dialer_uses_the_first_live_relay_blames_the_relay_only_when_it_died():
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S), echo_worker() as worker:
            async with trio.open_nursery() as nursery:
                scope_a = trio.CancelScope()

                async def relay_a(task_status=trio.TASK_STATUS_IGNORED):
                    with scope_a:
                        await run_relay(task_status=task_status)

                a = await nursery.start(relay_a)
                b = await nursery.start(run_relay)
                home, dialer = new_host(), new_host()
                async with home.run(LOOPBACK), dialer.run(LOOPBACK), stop_service(home):
                    server = RelayedSessionServer(worker)
                    server.attach(home)
                    home_id = home.get_id().to_base58()
                    addrs = [relayed_addrs(await reserve(home, info(r)), home_id)[0] for r in (a, b)]
                    relay_a_id, relay_b_id = (r.get_id().to_base58() for r in (a, b))
                    dial = RelayDialer(dialer, Portal.current())
                    connector = PeerConnector(self_peer_id="entry", relay_dialer=dial,
                                              relayed_addrs=lambda peer: addrs if peer == home_id else ())
                    hop = Hop(home_id, 2, 4, 2, True)

                    def through_a():
                        ch = connector.transport(hop)
                        return echo_once(ch, b"one"), echo_once(ch, b"two" * 500)
                    assert await trio.to_thread.run_sync(through_a) == ([ECHO_PREFIX + b"one"],
                                                                         [ECHO_PREFIX + b"two" * 500])
                    assert dial._circuits[home_id][0] == relay_a_id

                    # A failure while the relay is alive is the peer's: the relay stays usable.
                    assert not await trio.to_thread.run_sync(connector.retry_same_peer, home_id)
                    assert not dial.relay_failed_recently(relay_a_id)

                    def again():
                        return echo_once(connector.transport(hop), b"three")
                    assert await trio.to_thread.run_sync(again) == [ECHO_PREFIX + b"three"]
                    assert dial._circuits[home_id][0] == relay_a_id

                    # Relay A dies: the hop's failure is the relay's, the same peer is retried via B.
                    scope_a.cancel()
                    assert await trio.to_thread.run_sync(connector.retry_same_peer, home_id)
                    assert dial.relay_failed_recently(relay_a_id)
                    # a second generation that lost the same circuit gets the same answer
                    assert await trio.to_thread.run_sync(connector.retry_same_peer, home_id)
                    assert await trio.to_thread.run_sync(again) == [ECHO_PREFIX + b"three"]
                    assert dial._circuits[home_id][0] == relay_b_id

                    # Only the failed relay left: a clear HopFailure naming it, so the driver avoids the peer.
                    only_a = PeerConnector(self_peer_id="entry", relay_dialer=dial,
                                           relayed_addrs=lambda peer: addrs[:1])
                    dial._circuits.clear()
                    with pytest.raises(HopFailure, match="failed recently"):
                        await trio.to_thread.run_sync(only_a.transport, hop)
                    server.close()
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_connector_without_a_dialer_refuses_relayed_hops_and_skips_bad_addresses():
    with pytest.raises(HopFailure, match="no relay dialer"):
        PeerConnector(self_peer_id="me").transport(Hop("12D3KooWpeer", 0, 2, 0, True))
    dial = RelayDialer(host=None, portal=None)  # never dials: no usable address
    with pytest.raises(HopFailure, match="no relayed address"):
        dial.transport("12D3KooWpeer", ["/ip4/1.2.3.4/tcp/1", "not a multiaddr"])
    assert not dial.retry_same_peer("12D3KooWpeer")


def test_failed_relays_are_forgotten_after_the_memory_and_tables_stay_bounded():
    from meshd.reach.relay_dial import MAX_TRACKED_PEERS

    now = [0.0]
    dial = RelayDialer(host=None, portal=None, clock=lambda: now[0], memory_s=120.0)
    dial.mark_failed("relay-x")
    now[0] = 119.9
    assert dial.relay_failed_recently("relay-x")
    now[0] = 120.0
    assert not dial.relay_failed_recently("relay-x")
    for i in range(MAX_TRACKED_PEERS + 50):
        dial.mark_failed(f"relay-{i}")
    with pytest.raises(HopFailure):
        dial.transport("12D3KooWpeer", [])
    assert len(dial._failed) <= MAX_TRACKED_PEERS
