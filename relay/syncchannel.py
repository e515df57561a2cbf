"""Relayed hops for synchronous callers (the route driver): a grpc.Channel look-alike.

The route driver (meshd/generate/driver.py) speaks to every hop through a
channel and only calls
``channel.stream_stream(SESSION_METHOD, request_serializer=None,
response_deserializer=None)(request_iterator, timeout=...)`` (raw bytes in,
raw bytes out), ``.cancel()`` on the call, and ``channel.close()``. So a
relayed hop plugs in with no change to the driver:

    driver thread ─ RequestQueue.put ─ run_sync_soon ─▶ trio writer task ─▶ stream
      (any other request_iterator: ─▶ pump thread ─ run_sync_soon ─▶ ...)
    driver thread ◀── next(call): Inbox.get() ◀──────────────────────── trio reader task ◀─ stream

``TrioPortal`` runs one trio loop (the libp2p host) in a background thread
and lets plain threads call into it. A call holds at most CALL_QUEUE_FRAMES
frames per direction besides the driver's queue and the libp2p stream; a
frame crosses threads once (see ``_RelayedCall``). Only ``portal.run`` is
needed from a portal, so the daemon's own portal works too.

Endpoints: ``RELAYED_SCHEME + <peer id>`` names a relayed hop; a
``channel_factory`` from ``relayed_channel_factory`` sends those through the
portal and everything else to the direct gRPC factory it wraps.
"""
from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import trio
from libp2p.peer.id import ID

from proto.errors import ProtocolError
from relay import trace
from relay.errors import RelayError, RelayUnreachable
from relay.handoff import Inbox
from relay.transport import RelayedFrameChannel, open_session_channel

__all__ = ["TrioPortal", "RelayedGrpcChannel", "RelayedRpcError", "relayed_channel_factory", "RELAYED_SCHEME"]

RELAYED_SCHEME = "p2p:"
# Joining the portal thread after cancel: the host closes its listeners first.
PORTAL_STOP_TIMEOUT_S = 30.0
# Frames of one relayed call waiting between the driver's threads and the stream,
# per direction: 2 lets the next request queue while one is in flight, like the bridge.
CALL_QUEUE_FRAMES = 2
# How often a pump blocked on a full queue checks whether its call was cancelled.
PUMP_POLL_S = 0.5
_END = object()


class TrioPortal:
    """A trio loop in a daemon thread running ``setup(task_status)`` until ``stop()``."""

    def __init__(self, setup: Callable[..., Awaitable[object]]) -> None:
        self._setup = setup
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scopes: list[trio.CancelScope] = []   # the writer's and the reader's
        self.value: Any = None   # what setup passed to task_status.started()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="trio-portal", daemon=True)

    def __enter__(self) -> TrioPortal:
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
    """One Session call over a relayed stream: iterate for responses, ``cancel()`` to reset.

    Two tasks in the portal's trio loop own the stream for the call's life (a
    writer fed by a memory channel, a reader filling an ``Inbox``); they end at
    the stream's end, on a failure, or when ``cancel()`` cancels their scope.
    Each frame crosses threads once: the pump thread hands a request to trio
    with ``run_sync_soon`` (no wait for the write), the reader hands a response
    to the driver thread through the inbox (no round trip into trio per
    ``next``). Credits bound both directions to CALL_QUEUE_FRAMES frames.
    """

    def __init__(self, portal: TrioPortal, channel: RelayedFrameChannel, requests: Iterator[bytes]) -> None:
        self._portal, self._channel = portal, channel
        self._done = False
        self._sent_all = False      # we half-closed: an end of stream is now the normal end
        self._inbox: Inbox = Inbox(CALL_QUEUE_FRAMES)
        # A RequestQueue (shard/request_queue.py) lets the driver's thread hand frames to
        # trio itself, with the queue's own depth as the credit; any other iterator is
        # drained by a pump thread (one more hand-off per frame).
        attach = getattr(requests, "attach", None)
        depth = getattr(requests, "depth", None)
        self._depth = depth if attach is not None and depth is not None else CALL_QUEUE_FRAMES
        self._up = threading.Semaphore(self._depth)   # requests handed to trio, not yet written
        self._scopes: list[trio.CancelScope] = []   # the writer's and the reader's
        try:
            self._token, self._to_writer = portal.run(self._start)
        except RelayError as exc:       # the loop has stopped: the driver sees a failed hop
            raise RelayedRpcError(exc) from exc
        self._pump: threading.Thread | None = None
        if attach is not None:
            attach(self._push, self._push_end)
        else:
            self._pump = threading.Thread(target=self._send_all, args=(requests,), daemon=True,
                                          name="relayed-call-pump")
            self._pump.start()

    # ------------------------------------------------------------- trio side

    async def _start(self):
        """In the portal's loop: the writer and reader tasks, each under a scope ``cancel()`` cancels."""
        send, receive = trio.open_memory_channel(self._depth + 1)   # + the end marker
        # Scopes exist before the tasks run, so a cancel() that comes first still reaches them.
        self._scopes = [trio.CancelScope(), trio.CancelScope()]
        trio.lowlevel.spawn_system_task(self._guarded, self._scopes[0], self._write_all, receive,
                                        name="relayed-call-writer")
        trio.lowlevel.spawn_system_task(self._guarded, self._scopes[1], self._read_all, name="relayed-call-reader")
        return trio.lowlevel.current_trio_token(), send

    async def _guarded(self, scope: trio.CancelScope, afn, *args) -> None:
        """A system task must never raise: failures go to the driver through the inbox."""
        with scope:
            try:
                await afn(*args)
            except Exception as exc:  # noqa: BLE001 - RelayError, ProtocolError, or a library surprise
                self._stop_tasks()          # the other task stops too
                cause = exc if isinstance(exc, (RelayError, ProtocolError)) else RelayUnreachable(repr(exc))
                self._inbox.put(RelayedRpcError(cause))
                await self._channel.reset()

    def _stop_tasks(self) -> None:
        for scope in self._scopes:
            scope.cancel()

    async def _write_all(self, requests) -> None:
        async for body in requests:
            if body is _END:
                self._sent_all = True
                await self._channel.close()
                return
            await self._channel.send(body)
            self._up.release()

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

    # ----------------------------------------------------------- pump thread

    def _send_all(self, requests: Iterator[bytes]) -> None:
        for body in requests:
            if not self._push(body):
                return
        self._push_end()

    def _push(self, body: bytes) -> bool:
        """Hand one request to the writer task (in the caller's thread); False once the call is over."""
        trace.mark("e.pump_got")
        while not self._up.acquire(timeout=PUMP_POLL_S):
            if self._done:
                return False
        if self._done:
            return False
        try:
            self._token.run_sync_soon(self._hand_over, body)
        except trio.RunFinishedError:
            self._inbox.put(RelayedRpcError(RelayUnreachable("the libp2p loop has stopped")))
            return False
        return True

    def _push_end(self) -> None:
        try:
            self._token.run_sync_soon(self._hand_over, _END)
        except trio.RunFinishedError:
            self._inbox.put(RelayedRpcError(RelayUnreachable("the libp2p loop has stopped")))

    def _hand_over(self, item) -> None:
        trace.mark("e.trio_got")
        try:
            self._to_writer.send_nowait(item)   # never full: bounded by self._up
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass    # the writer is gone; the reader reports why

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
        try:
            self._token.run_sync_soon(self._stop_tasks)
        except trio.RunFinishedError:
            pass

    def _wake(self, event: trio.Event) -> None:
        try:
            self._token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    def cancel(self) -> None:
        if self._done:
            return
        self._done = True
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

    def __init__(self, portal, open_stream: Callable[[], Awaitable[RelayedFrameChannel]], *, conn=None) -> None:
        self._portal, self._open_stream = portal, open_stream
        self.conn = conn        # the one connection its streams open on, when it has one

    @classmethod
    def to_peer(cls, portal, host, peer_id: ID) -> RelayedGrpcChannel:
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


def relayed_channel_factory(portal: TrioPortal, host, direct_factory: Callable[[str], object]):
    """A ``channel_factory(endpoint)``: ``p2p:<peer id>`` endpoints go through the portal."""
    def factory(endpoint: str):
        if endpoint.startswith(RELAYED_SCHEME):
            return RelayedGrpcChannel.to_peer(portal, host, ID.from_base58(endpoint[len(RELAYED_SCHEME):]))
        return direct_factory(endpoint)
    return factory
