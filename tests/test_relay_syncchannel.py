"""The grpc.Channel look-alike that lets the (synchronous) route driver use relayed hops."""
from __future__ import annotations

import queue

import grpc
import pytest
import trio
from libp2p.tools.anyio_service import background_trio_service

from relay.client import dial_relayed, reserve, stop_service
from relay.hop import HopService
from relay.portal import LoopThread
from relay.syncchannel import SESSION_METHOD, RelayedRpcError, relayed_channel_factory
from relay.transport import RelayedSessionServer
from shard.session.request_queue import RequestQueue
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


def test_driver_shaped_calls_travel_through_the_relay():
    with echo_worker() as target, _portal(target) as portal:
        dialer, home_id = portal.value
        factory = relayed_channel_factory(portal, dialer, direct_factory=lambda e: pytest.fail("not direct"))
        channel = factory(f"p2p:{home_id.to_base58()}")
        requests: queue.Queue = queue.Queue(maxsize=4)
        end = object()
        call = channel.stream_stream(SESSION_METHOD, request_serializer=None,
                                     response_deserializer=None)(iter(requests.get, end), timeout=60)
        for body in (b"open", b"step" * 500):
            requests.put(body)
            assert next(call) == ECHO_PREFIX + body
        requests.put(end)
        assert list(call) == []        # the worker ends the stream after our half-close
        channel.close()
        with pytest.raises(ValueError):
            channel.stream_stream(SESSION_METHOD, request_serializer=bytes)


def test_a_peer_without_the_session_protocol_fails_as_an_rpc_error():
    with _portal(None) as portal:
        dialer, home_id = portal.value
        channel = relayed_channel_factory(portal, dialer, direct_factory=None)(f"p2p:{home_id.to_base58()}")
        with pytest.raises(grpc.RpcError) as err:
            channel.stream_stream(SESSION_METHOD)(iter([b"x"]))
        assert isinstance(err.value, RelayedRpcError) and err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_pipelined_requests_come_back_in_order_and_cancel_ends_the_call():
    with echo_worker() as target, _portal(target) as portal:
        dialer, home_id = portal.value
        channel = relayed_channel_factory(portal, dialer, direct_factory=None)(f"p2p:{home_id.to_base58()}")
        requests: queue.Queue = queue.Queue(maxsize=16)
        call = channel.stream_stream(SESSION_METHOD)(iter(requests.get, object()), timeout=60)
        bodies = [b"%d" % i * (1 + 100 * i) for i in range(12)]
        for body in bodies:                 # more than CALL_QUEUE_FRAMES before reading any
            requests.put(body)
        assert [next(call) for _ in bodies] == [ECHO_PREFIX + b for b in bodies]
        call.cancel()                        # the driver's close(): the stream is reset
        assert list(call) == []
        requests.put(b"after cancel")        # the pump takes it, sees the call is over and stops
        call._pump.join(10)
        assert not call._pump.is_alive()


def test_a_request_queue_hands_frames_over_from_the_driver_thread_without_a_pump():
    with echo_worker() as target, _portal(target) as portal:
        dialer, home_id = portal.value
        channel = relayed_channel_factory(portal, dialer, direct_factory=None)(f"p2p:{home_id.to_base58()}")
        requests = RequestQueue(16)
        call = channel.stream_stream(SESSION_METHOD)(requests, timeout=60)
        assert call._pump is None
        bodies = [b"%d" % i * (1 + 100 * i) for i in range(12)]
        for body in bodies:                 # more than CALL_QUEUE_FRAMES before reading any
            requests.put(body)
        assert [next(call) for _ in bodies] == [ECHO_PREFIX + b for b in bodies]
        requests.finish()                   # our half-close: the echo ends its side too
        assert list(call) == []
        requests.put(b"after the end")      # returns at once: the call is over
        requests.finish()


def test_a_home_node_whose_worker_is_gone_fails_the_call_as_an_rpc_error():
    """The home's worker link fails (nothing listens), it resets the stream, the driver sees UNAVAILABLE."""
    with _portal("unix:/nonexistent/meshd-test/w.sock") as portal:
        dialer, home_id = portal.value
        channel = relayed_channel_factory(portal, dialer, direct_factory=None)(f"p2p:{home_id.to_base58()}")
        requests: queue.Queue = queue.Queue(maxsize=4)
        call = channel.stream_stream(SESSION_METHOD)(iter(requests.get, None), timeout=60)
        requests.put(b"open")
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(StopIteration):
            next(call)
        requests.put(None)
        call._pump.join(10)
        assert not call._pump.is_alive()


def test_a_driver_waiting_on_a_call_is_released_when_the_libp2p_loop_stops():
    with echo_worker() as target:
        portal = _portal(target)
        with portal:
            dialer, home_id = portal.value
            channel = relayed_channel_factory(portal, dialer, direct_factory=None)(f"p2p:{home_id.to_base58()}")
            requests: queue.Queue = queue.Queue(maxsize=4)
            call = channel.stream_stream(SESSION_METHOD)(iter(requests.get, None), timeout=60)
        # The portal's loop is gone (its tasks were cancelled with it): no hang, a failed hop.
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        requests.put(None)
        call._pump.join(10)
        assert not call._pump.is_alive()
        with pytest.raises(grpc.RpcError):      # a new call on a stopped loop fails the same way
            channel.stream_stream(SESSION_METHOD)(iter([b"x"]))
