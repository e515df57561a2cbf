"""Relayed hops for synchronous callers (the route driver): a grpc.Channel look-alike.

The route driver (meshd/generate/driver.py) speaks to every hop through a
channel and only calls
``channel.stream_stream(SESSION_METHOD, request_serializer=None,
response_deserializer=None)(request_iterator, timeout=...)`` (raw bytes in,
raw bytes out), ``.cancel()`` on the call, and ``channel.close()``. So a
relayed hop plugs in with no change to the driver:

    driver thread ─ RequestQueue.put ─ Outbox.put ─ post ─▶ trio writer task ─▶ stream
      (any other request_iterator: ─▶ pump thread ─ Outbox.put ─▶ ...)
    driver thread ◀── next(call): Inbox.get() ◀──────────────────── trio reader task ◀─ stream

Every crossing between the driver's thread and the libp2p host's trio loop
goes through a ``relay.portal.Portal`` (the daemon's own, or a LoopThread's in
tests and the relay benchmark): a call holds at most CALL_QUEUE_FRAMES frames
per direction besides the driver's queue and the libp2p stream, and a frame
crosses threads once (see ``_RelayedCall``).

Endpoints: ``RELAYED_SCHEME + <peer id>`` names a relayed hop; a
``channel_factory`` from ``relayed_channel_factory`` sends those through the
portal and everything else to the direct gRPC factory it wraps.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import grpc
import trio
from libp2p.peer.id import ID

from proto.errors import ProtocolError
from proto.threads import ThreadGroup
from relay import trace
from relay.errors import RelayError, RelayUnreachable
from relay.portal import Inbox, Outbox, Portal
from relay.transport import RelayedFrameChannel, open_session_channel

__all__ = ["RelayedGrpcChannel", "RelayedRpcError", "relayed_channel_factory", "RELAYED_SCHEME",
           "SESSION_METHOD"]

RELAYED_SCHEME = "p2p:"
# The one method a relayed hop carries (the Session stream), as gRPC names it.
SESSION_METHOD = "/meshd.shard.v1.ShardRuntime/Session"
# Frames of one relayed call waiting between the driver's threads and the stream,
# per direction: 2 lets the next request queue while one is in flight.
CALL_QUEUE_FRAMES = 2
# How often a pump blocked on a full queue checks whether its call was cancelled.
PUMP_POLL_S = 0.5


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
    """One Session call over a relayed stream: iterate for responses, ``cancel()`` to reset.

    Two tasks in the portal's trio loop own the stream for the call's life (a
    writer fed by an ``Outbox``, a reader filling an ``Inbox``); they end at
    the stream's end, on a failure, or when ``cancel()`` cancels their scope.
    Each frame crosses threads once: the driver's thread posts a request to
    trio (no wait for the write), the reader hands a response to the driver
    thread through the inbox (no round trip into trio per ``next``). Both
    directions are bounded to CALL_QUEUE_FRAMES frames (the request queue's
    own depth when the driver's RequestQueue is attached).

    A plain request iterator (tests) is drained by a pump thread in the call's
    ThreadGroup; it ends with the iterator, or at its first item once the call
    is over (it cannot be woken inside someone else's iterator). The driver
    always attaches a RequestQueue: the daemon starts no pump.
    """

    def __init__(self, portal: Portal, channel: RelayedFrameChannel, requests: Iterator[bytes]) -> None:
        self._portal, self._channel = portal, channel
        self._done = False
        self._sent_all = False      # we half-closed: an end of stream is now the normal end
        self._inbox: Inbox = Inbox(CALL_QUEUE_FRAMES)
        # A RequestQueue (shard/session/request_queue.py) lets the driver's thread hand frames to
        # trio itself, with the queue's own depth as the credit; any other iterator is
        # drained by a pump thread (one more hand-off per frame).
        attach = getattr(requests, "attach", None)
        depth = getattr(requests, "depth", None)
        depth = depth if attach is not None and depth is not None else CALL_QUEUE_FRAMES
        self._up: Outbox[bytes] = Outbox(portal, depth, poll_s=PUMP_POLL_S)   # requests, not yet written
        self._scopes: list[trio.CancelScope] = []   # the writer's and the reader's
        try:
            portal.run(self._start)
        except RelayError as exc:       # the loop has stopped: the driver sees a failed hop
            raise RelayedRpcError(exc) from exc
        self._threads = ThreadGroup("relayed-call")
        self._pump = None
        if attach is not None:
            attach(self._push, self._push_end)
        else:
            self._pump = self._threads.start(self._send_all, requests, name="pump")

    # ------------------------------------------------------------- trio side

    async def _start(self) -> None:
        """In the portal's loop: the writer and reader tasks, each under a scope ``cancel()`` cancels."""
        # Scopes exist before the tasks run, so a cancel() that comes first still reaches them.
        self._scopes = [trio.CancelScope(), trio.CancelScope()]
        trio.lowlevel.spawn_system_task(self._guarded, self._scopes[0], self._write_all, name="relayed-call-writer")
        trio.lowlevel.spawn_system_task(self._guarded, self._scopes[1], self._read_all, name="relayed-call-reader")

    async def _guarded(self, scope: trio.CancelScope, afn) -> None:
        """A system task must never raise: failures go to the driver through the inbox."""
        with scope:
            try:
                await afn()
            except Exception as exc:  # noqa: BLE001 - RelayError, ProtocolError, or a library surprise
                self._stop_tasks()          # the other task stops too
                cause = exc if isinstance(exc, (RelayError, ProtocolError)) else RelayUnreachable(repr(exc))
                self._inbox.put(RelayedRpcError(cause))
                await self._channel.reset()

    def _stop_tasks(self) -> None:
        for scope in self._scopes:
            scope.cancel()

    async def _write_all(self) -> None:
        async for body in self._up:
            trace.mark("e.trio_got")
            await self._channel.send(body)
            self._up.give_back()
        self._sent_all = True               # the driver ended its requests: half-close
        await self._channel.close()

    async def _read_all(self) -> None:
        try:
            while True:
                while (waiter := self._inbox.credits.take(trio.Event)) is not None:
                    await waiter.wait()
                body = await self._channel.receive()
                self._inbox.put(body)
                if body is None:
                    return
        except trio.Cancelled:
            if not self._done:
                # Not our cancel(): a failed writer (its error is already queued first)
                # or the portal's loop stopping under a driver that still waits.
                self._inbox.put(RelayedRpcError(RelayUnreachable("the libp2p loop has stopped")))
            raise

    # ------------------------------------------------ driver thread / pump thread

    def _send_all(self, requests: Iterator[bytes]) -> None:
        for body in requests:
            if not self._push(body):
                return
        self._push_end()

    def _push(self, body: bytes) -> bool:
        """Hand one request to the writer task (in the caller's thread); False once the call is over."""
        trace.mark("e.pump_got")
        try:
            return self._up.put(body, gone=lambda: self._done)
        except RelayError:
            self._inbox.put(RelayedRpcError(RelayUnreachable("the libp2p loop has stopped")))
            return False

    def _push_end(self) -> None:
        try:
            self._up.close()
        except RelayError:
            self._inbox.put(RelayedRpcError(RelayUnreachable("the libp2p loop has stopped")))

    # ---------------------------------------------------------- driver thread

    def __iter__(self) -> _RelayedCall:
        return self

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        item, waiter = self._inbox.get()
        if waiter is not None:
            assert isinstance(waiter, trio.Event)   # the waiters our trio side makes (_read_all)
            self._wake(waiter)
        if isinstance(item, RelayedRpcError):
            self._finish()
            raise item
        if item is None:
            self._finish()
            if not self._sent_all:
                # The server never ends a session first (a terminal ShardStatus would
                # have come before): the circuit or the relay went away.
                raise RelayedRpcError(RelayUnreachable("the relayed stream ended before our half-close"))
            raise StopIteration
        trace.mark("e.next_return")
        return item

    def _finish(self) -> None:
        """The call is over: make sure neither task outlives it (a writer may still wait)."""
        self._done = True
        self._threads.stop()
        try:
            self._portal.post(self._stop_tasks)
        except RelayError:
            pass

    def _wake(self, event: trio.Event) -> None:
        try:
            self._portal.post(event.set)
        except RelayError:
            pass

    def cancel(self) -> None:
        if self._done:
            return
        self._done = True
        self._threads.stop()
        try:
            self._portal.run(self._cancel)
        except RelayError:
            pass

    async def _cancel(self) -> None:
        self._stop_tasks()
        await self._channel.reset()


class RelayedGrpcChannel:
    """The subset of grpc.Channel the route driver uses, over libp2p session streams.

    ``open_stream()`` (a coroutine function, run in the portal's loop) opens the
    stream of one Session call: a new stream to a peer (``to_peer``) or on one
    given connection ``conn``, meshd/reach/relay_dial.py)."""

    def __init__(self, portal: Portal, open_stream: Callable[[], Awaitable[RelayedFrameChannel]], *,
                 conn=None) -> None:
        self._portal, self._open_stream = portal, open_stream
        self.conn = conn        # the one connection its streams open on, when it has one

    @classmethod
    def to_peer(cls, portal: Portal, host, peer_id: ID) -> RelayedGrpcChannel:
        return cls(portal, lambda: open_session_channel(host, peer_id))

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None):
        if request_serializer is not None or response_deserializer is not None:
            raise ValueError("relayed hops carry serialized frames: use raw-bytes (de)serializers")
        if not method.endswith("/Session"):
            raise ValueError(f"only the Session method travels over relayed hops, not {method}")

        def call(request_iterator, timeout=None) -> _RelayedCall:
            try:
                channel = self._portal.run(self._open_stream)
            except RelayError as exc:
                raise RelayedRpcError(exc) from exc
            return _RelayedCall(self._portal, channel, request_iterator)
        return call

    def unary_unary(self, method: str, **_):
        def call(*args, **kwargs):
            raise RelayedRpcError(RelayUnreachable(
                f"{method} is not carried over relayed hops; pass the route's fingerprint"))
        return call

    def close(self) -> None:
        pass


def relayed_channel_factory(portal: Portal, host, direct_factory: Callable[[str], object]):
    """A ``channel_factory(endpoint)``: ``p2p:<peer id>`` endpoints go through the portal."""
    def factory(endpoint: str):
        if endpoint.startswith(RELAYED_SCHEME):
            return RelayedGrpcChannel.to_peer(portal, host, ID.from_base58(endpoint[len(RELAYED_SCHEME):]))
        return direct_factory(endpoint)
    return factory
