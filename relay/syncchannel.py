"""Relayed hops for synchronous callers (the RouteDriver): a grpc.Channel look-alike.

The route driver (shard/driver.py) speaks to every hop through
``channel_factory(endpoint) -> channel`` and only calls
``channel.stream_stream(SESSION_METHOD, request_serializer=None,
response_deserializer=None)(request_iterator, timeout=...)`` (raw bytes in,
raw bytes out), ``.cancel()`` on the call, and ``channel.close()``. So a
relayed hop plugs in with no change to the driver:

    driver thread ─ request_iterator ─▶ pump thread ─ portal.run(send) ─▶ trio: RelayedFrameChannel
    driver thread ◀── next(call) = portal.run(receive) ◀──────────────── trio

``TrioPortal`` runs one trio loop (the libp2p host) in a background thread
and lets plain threads call into it. The channel holds no frames of its own:
the driver's queue and the libp2p stream are the only buffers.

Endpoints: ``RELAYED_SCHEME + <peer id>`` names a relayed hop; a
``channel_factory`` from ``relayed_channel_factory`` sends those through the
portal and everything else to the direct gRPC factory it wraps.
"""
from __future__ import annotations

import threading
from typing import Awaitable, Callable, Iterator

import grpc
import trio
from libp2p.peer.id import ID

from proto.errors import ProtocolError
from relay import trace
from relay.errors import RelayError, RelayUnreachable
from relay.transport import RelayedFrameChannel, open_session_channel

__all__ = ["TrioPortal", "RelayedGrpcChannel", "RelayedRpcError", "relayed_channel_factory", "RELAYED_SCHEME"]

RELAYED_SCHEME = "p2p:"
# Joining the portal thread after cancel: the host closes its listeners first.
PORTAL_STOP_TIMEOUT_S = 30.0


class TrioPortal:
    """A trio loop in a daemon thread running ``setup(task_status)`` until ``stop()``."""

    def __init__(self, setup: Callable[..., Awaitable[None]]) -> None:
        self._setup = setup
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self.value = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="trio-portal", daemon=True)

    def __enter__(self) -> "TrioPortal":
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                self.value = await nursery.start(self._setup)
                self._ready.set()
        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller of __enter__
            self.error = exc
        finally:
            self._ready.set()

    def run(self, afn, *args):
        """Run ``await afn(*args)`` in the portal's loop from a plain thread."""
        try:
            return trio.from_thread.run(afn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise RelayUnreachable("the libp2p loop has stopped") from exc

    def stop(self) -> None:
        if self._token is not None and self._scope is not None:
            try:
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(PORTAL_STOP_TIMEOUT_S)


class RelayedRpcError(grpc.RpcError):
    """How a relayed hop's failure reaches gRPC-shaped callers (the driver maps RpcError)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self._cause = cause

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"relayed hop: {self._cause}"


class _RelayedCall:
    """One Session call over a relayed stream: iterate for responses, ``cancel()`` to reset."""

    def __init__(self, portal: TrioPortal, channel: RelayedFrameChannel, requests: Iterator[bytes]) -> None:
        self._portal, self._channel = portal, channel
        self._done = False
        self._sent_all = False      # we half-closed: an end of stream is now the normal end
        self._pump = threading.Thread(target=self._send_all, args=(requests,), daemon=True,
                                      name="relayed-call-pump")
        self._pump.start()

    def _send_all(self, requests: Iterator[bytes]) -> None:
        try:
            for body in requests:
                if self._done:
                    return
                trace.mark("e.pump_got")
                self._portal.run(self._channel.send, body)
            self._sent_all = True
            self._portal.run(self._channel.close)
        except RelayError:
            self.cancel()   # the driver sees the failure on its next read

    def __iter__(self) -> "_RelayedCall":
        return self

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        try:
            body = self._portal.run(self._channel.receive)
        except (RelayError, ProtocolError) as exc:
            self._done = True
            raise RelayedRpcError(exc) from exc
        if body is None:
            self._done = True
            if not self._sent_all:
                # The server never ends a session first (a terminal ShardStatus would
                # have come before): the circuit or the relay went away.
                raise RelayedRpcError(RelayUnreachable("the relayed stream ended before our half-close"))
            raise StopIteration
        trace.mark("e.next_return")
        return body

    def cancel(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._portal.run(self._channel.reset)
        except RelayError:
            pass


class RelayedGrpcChannel:
    """The subset of grpc.Channel the route driver uses, over relayed session streams."""

    def __init__(self, portal: TrioPortal, host, peer_id: ID) -> None:
        self._portal, self._host, self._peer = portal, host, peer_id

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None):
        if request_serializer is not None or response_deserializer is not None:
            raise ValueError("relayed hops carry serialized frames: use raw-bytes (de)serializers")
        if not method.endswith("/Session"):
            raise ValueError(f"only the Session method travels over relayed hops, not {method}")

        def call(request_iterator, timeout=None) -> _RelayedCall:
            try:
                channel = self._portal.run(open_session_channel, self._host, self._peer)
            except RelayError as exc:
                raise RelayedRpcError(exc) from exc
            return _RelayedCall(self._portal, channel, request_iterator)
        return call

    def unary_unary(self, method: str, **_):
        raise RelayUnreachable(f"{method} is not available over a relayed hop; pass the route's fingerprint")

    def close(self) -> None:
        pass


def relayed_channel_factory(portal: TrioPortal, host, direct_factory: Callable[[str], object]):
    """A RouteDriver ``channel_factory``: ``p2p:<peer id>`` endpoints go through the portal."""
    def factory(endpoint: str):
        if endpoint.startswith(RELAYED_SCHEME):
            return RelayedGrpcChannel(portal, host, ID.from_base58(endpoint[len(RELAYED_SCHEME):]))
        return direct_factory(endpoint)
    return factory
