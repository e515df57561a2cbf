"""The relayed HopTransport (relay/syncchannel.py) that lets the (synchronous) route driver use relayed hops."""
from __future__ import annotations

import pytest
import trio
from libp2p.tools.anyio_service import background_trio_service

from proto.hop_transport import TransportError, TransportStatus, Unary
from relay.client import dial_relayed, reserve, stop_service
from relay.hop import HopService
from relay.portal import LoopThread
from relay.syncchannel import relayed_transport_factory
from relay.transport import RelayedSessionServer
from tests._relay_helpers import ECHO_PREFIX, LOOPBACK, echo_worker, info, new_host


def _portal(target: str | None):
    """A relay, a home node serving ``target`` (or nothing) and a dialer, all in the portal's loop."""
    async def setup(task_status=trio.TASK_STATUS_IGNORED):
        relay, home, dialer = new_host(), new_host(), new_host()
        async with relay.run(LOOPBACK), home.run(LOOPBACK), dialer.run(LOOPBACK):
            hop = HopService(relay)
            async with background_trio_service(hop), stop_service(home):
                await hop.event_started.wait()
                server = RelayedSessionServer(target) if target else None
                if server:
                    server.attach(home)
                await reserve(home, info(relay))
                await dial_relayed(dialer, info(relay), home.get_id())
                task_status.started((dialer, home.get_id()))
                try:
                    await trio.sleep_forever()
                finally:
                    if server:
                        server.close()
    return LoopThread(setup)


def _relayed(portal, dialer, home_id):
    return relayed_transport_factory(portal, dialer, direct_factory=None)(f"p2p:{home_id.to_base58()}")


def test_driver_shaped_calls_travel_through_the_relay():
    with echo_worker() as target, _portal(target) as portal:
        dialer, home_id = portal.value
        factory = relayed_transport_factory(portal, dialer, direct_factory=lambda e: pytest.fail("not direct"))
        transport = factory(f"p2p:{home_id.to_base58()}")
        assert transport.kind == "relayed"
        stream = transport.open_session()
        for body in (b"open", b"step" * 500):
            stream.send(body)
            assert stream.receive() == ECHO_PREFIX + body
        stream.close_send()
        assert stream.receive() is None     # the worker ends the stream after our half-close
        transport.close()
        with pytest.raises(TransportError) as err:
            transport.unary(Unary.CAPABILITY, b"", 5)
        assert err.value.status == TransportStatus.UNIMPLEMENTED


def test_a_peer_without_the_session_protocol_fails_as_a_transport_error():
    with _portal(None) as portal:
        dialer, home_id = portal.value
        with pytest.raises(TransportError) as err:
            _relayed(portal, dialer, home_id).open_session()
        assert err.value.status == TransportStatus.UNAVAILABLE and "relayed hop" in str(err.value)


def test_pipelined_requests_come_back_in_order_and_cancel_ends_the_call():
    with echo_worker() as target, _portal(target) as portal:
        dialer, home_id = portal.value
        stream = _relayed(portal, dialer, home_id).open_session()
        bodies = [b"%d" % i * (1 + 100 * i) for i in range(12)]
        for body in bodies:                 # more than CALL_QUEUE_FRAMES before reading any, from this thread
            stream.send(body)
        assert [stream.receive() for _ in bodies] == [ECHO_PREFIX + b for b in bodies]
        stream.cancel()                     # the driver's close(): the stream is reset
        with pytest.raises(TransportError) as err:
            stream.receive()
        assert err.value.status == TransportStatus.CANCELLED
        stream.send(b"after cancel")        # returns at once: the stream is over
        stream.close_send()


def test_a_half_close_ends_the_stream_after_the_answers():
    with echo_worker() as target, _portal(target) as portal:
        dialer, home_id = portal.value
        stream = _relayed(portal, dialer, home_id).open_session()
        bodies = [b"%d" % i * (1 + 100 * i) for i in range(12)]
        for body in bodies:
            stream.send(body)
        stream.close_send()                 # our half-close: the echo ends its side too
        assert [stream.receive() for _ in bodies] == [ECHO_PREFIX + b for b in bodies]
        assert stream.receive() is None
        stream.send(b"after the end")      # returns at once: the stream is over
        stream.close_send()


def test_a_home_node_whose_worker_is_gone_fails_the_call_as_a_transport_error():
    """The home's worker link fails (nothing listens), it resets the stream, the driver sees UNAVAILABLE."""
    with _portal("unix:/nonexistent/meshd-test/w.sock") as portal:
        dialer, home_id = portal.value
        stream = _relayed(portal, dialer, home_id).open_session()
        stream.send(b"open")
        with pytest.raises(TransportError) as err:
            stream.receive()
        assert err.value.status == TransportStatus.UNAVAILABLE
        with pytest.raises(TransportError):    # and stays over
            stream.receive()


def test_a_driver_waiting_on_a_call_is_released_when_the_libp2p_loop_stops():
    with echo_worker() as target:
        portal = _portal(target)
        with portal:
            dialer, home_id = portal.value
            transport = _relayed(portal, dialer, home_id)
            stream = transport.open_session()
        # The portal's loop is gone (its tasks were cancelled with it): no hang, a failed hop.
        with pytest.raises(TransportError) as err:
            stream.receive()
        assert err.value.status == TransportStatus.UNAVAILABLE
        with pytest.raises(TransportError):      # a new stream on a stopped loop fails the same way
            transport.open_session()
