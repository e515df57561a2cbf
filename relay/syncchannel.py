"""Relayed hops for synchronous callers (the route driver): a proto.hop_transport.HopTransport.

The route driver (meshd/generate/driver.py) speaks to every hop through a
HopTransport: ``open_session()`` gives a stream to ``send`` request bodies on
and ``receive`` response bodies from (raw bytes both ways), ``cancel()`` it,
``close()`` the transport. A relayed hop is one more implementation:

    driver thread ─ send ─ Outbox.put ─ post ─▶ trio writer task ─▶ stream
    driver thread ◀── receive: Inbox.get() ◀──────────────────── trio reader task ◀─ stream

Every crossing between the driver's thread and the libp2p host's trio loop
goes through a ``relay.portal.Portal`` (the daemon's own, or a LoopThread's in
tests and the relay benchmark): a stream holds at most SEND_FRAMES requests
and CALL_QUEUE_FRAMES responses between the caller's threads and the libp2p
stream, and a frame crosses threads once (see ``RelayedStream``). It starts
no thread of its own.

Endpoints: ``RELAYED_SCHEME + <peer id>`` names a relayed hop; a
``transport_factory`` from ``relayed_transport_factory`` sends those through
the portal and everything else to the direct factory it wraps.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import trio
from libp2p.peer.id import ID

from proto.errors import ProtocolError
from proto.hop_transport import HopTransport, TransportError, TransportStatus, Unary
from relay import trace
from relay.errors import RelayError, RelayUnreachable
from relay.portal import Inbox, Outbox, Portal
from relay.transport import RelayedFrameChannel, open_session_channel

__all__ = ["RelayedTransport", "RelayedStream", "relayed_error", "relayed_transport_factory",
           "RELAYED_SCHEME"]

RELAYED_SCHEME = "p2p:"
# Frames of one relayed stream waiting between the libp2p stream and the receiving thread: 2
# lets the next response queue while one is being read.
CALL_QUEUE_FRAMES = 2
# Requests handed to trio, not yet written: the hop link's own bound (its credits bound it first).
SEND_FRAMES = 16
# How often a sender blocked on a full queue checks whether its stream ended.
PUMP_POLL_S = 0.5


def relayed_error(cause: BaseException) -> TransportError:
    """How a relayed hop's failure reaches the driver: the transport is unavailable."""
    return TransportError(f"relayed hop: {cause}", TransportStatus.UNAVAILABLE)


class RelayedStream:
    """One Session stream over a relayed libp2p stream (a proto.hop_transport.HopStream).

    Two tasks in the portal's trio loop own the libp2p stream for the session's life
    (a writer fed by an ``Outbox``, a reader filling an ``Inbox``); they end at the
    stream's end, on a failure, or when ``cancel()`` cancels their scope. Each frame
    crosses threads once: ``send`` posts a request to trio (no wait for the write),
    the reader hands a response to the receiving thread through the inbox (no round
    trip into trio per ``receive``). Both directions are bounded (SEND_FRAMES,
    CALL_QUEUE_FRAMES).
    """

    def __init__(self, portal: Portal, channel: RelayedFrameChannel) -> None:
        self._portal, self._channel = portal, channel
        self._done = False
        self._sent_all = False      # we half-closed: an end of stream is now the normal end
        self._inbox: Inbox = Inbox(CALL_QUEUE_FRAMES)
        self._up: Outbox[bytes] = Outbox(portal, SEND_FRAMES, poll_s=PUMP_POLL_S)   # requests, not yet written
        self._scopes: list[trio.CancelScope] = []   # the writer's and the reader's
        try:
            portal.run(self._start)
        except RelayError as exc:       # the loop has stopped: the driver sees a failed hop
            raise relayed_error(exc) from exc

    # ------------------------------------------------------------- trio side

    async def _start(self) -> None:
        """In the portal's loop: the writer and reader tasks, each under a scope ``cancel()`` cancels."""
        # Scopes exist before the tasks run, so a cancel() that comes first still reaches them.
        self._scopes = [trio.CancelScope(), trio.CancelScope()]
        trio.lowlevel.spawn_system_task(self._guarded, self._scopes[0], self._write_all, name="relayed-call-writer")
        trio.lowlevel.spawn_system_task(self._guarded, self._scopes[1], self._read_all, name="relayed-call-reader")

    async def _guarded(self, scope: trio.CancelScope, afn) -> None:
        """A system task must never raise: failures go to the receiver through the inbox."""
        with scope:
            try:
                await afn()
            except Exception as exc:  # noqa: BLE001 - RelayError, ProtocolError, or a library surprise
                self._stop_tasks()          # the other task stops too
                cause = exc if isinstance(exc, (RelayError, ProtocolError)) else RelayUnreachable(repr(exc))
                self._inbox.put(relayed_error(cause))
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
                self._inbox.put(relayed_error(RelayUnreachable("the libp2p loop has stopped")))
            raise

    # ----------------------------------------------------------- sending threads

    def send(self, body: bytes, timeout_s: float | None = None) -> None:
        """Hand one request to the writer task (in the caller's thread); nothing once the stream is over."""
        trace.mark("e.pump_got")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def gone() -> bool:
            return self._done or (deadline is not None and time.monotonic() >= deadline)
        try:
            if self._up.put(body, gone=gone) or self._done:
                return
        except RelayError:
            self._inbox.put(relayed_error(RelayUnreachable("the libp2p loop has stopped")))
            return
        raise TransportError(f"the relayed stream took no request for {timeout_s:.0f} s",
                             TransportStatus.DEADLINE_EXCEEDED)

    def close_send(self) -> None:
        if self._done:
            return
        try:
            self._up.close()
        except RelayError:
            self._inbox.put(relayed_error(RelayUnreachable("the libp2p loop has stopped")))

    # ---------------------------------------------------------- receiving thread

    def receive(self) -> bytes | None:
        if self._done:
            raise TransportError("the relayed stream is over", TransportStatus.CANCELLED)
        item, waiter = self._inbox.get()
        if isinstance(waiter, trio.Event):    # the reader task waits for this credit
            self._wake(waiter)
        if isinstance(item, TransportError):
            self._finish()
            raise item
        if item is None:
            self._finish()
            if not self._sent_all:
                # The server never ends a session first (a terminal ShardStatus would
                # have come before): the circuit or the relay went away.
                raise relayed_error(RelayUnreachable("the relayed stream ended before our half-close"))
            return None
        trace.mark("e.next_return")
        return item

    def _finish(self) -> None:
        """The stream is over: make sure neither task outlives it (a writer may still wait)."""
        self._done = True
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
        self._inbox.put(TransportError("the call was cancelled", TransportStatus.CANCELLED))
        try:
            self._portal.run(self._cancel)
        except RelayError:
            pass

    async def _cancel(self) -> None:
        self._stop_tasks()
        await self._channel.reset()


class RelayedTransport:
    """A proto.hop_transport.HopTransport over libp2p session streams.

    ``open_stream()`` (a coroutine function, run in the portal's loop) opens the
    stream of one session: a new stream to a peer (``to_peer``) or on one
    given connection ``conn`` (meshd/reach/relay_dial.py). Unary calls are not
    carried (capabilities do not travel over relays; the route's sessions check
    the fingerprint anyway, and an in-stream release is enough)."""

    kind = "relayed"

    def __init__(self, portal: Portal, open_stream: Callable[[], Awaitable[RelayedFrameChannel]], *,
                 conn=None) -> None:
        self._portal, self._open_stream = portal, open_stream
        self.conn = conn        # the one connection its streams open on, when it has one

    @classmethod
    def to_peer(cls, portal: Portal, host, peer_id: ID) -> RelayedTransport:
        return cls(portal, lambda: open_session_channel(host, peer_id))

    def open_session(self) -> RelayedStream:
        try:
            channel = self._portal.run(self._open_stream)
        except RelayError as exc:
            raise relayed_error(exc) from exc
        return RelayedStream(self._portal, channel)

    def unary(self, method: Unary, body: bytes, timeout_s: float) -> bytes:
        raise TransportError(f"{method.value} is not carried over relayed hops; pass the route's fingerprint",
                             TransportStatus.UNIMPLEMENTED)

    def close(self) -> None:
        pass


def relayed_transport_factory(portal: Portal, host, direct_factory: Callable[[str], HopTransport] | None
                              ) -> Callable[[str], HopTransport]:
    """A ``transport_factory(endpoint)``: ``p2p:<peer id>`` endpoints go through the portal, the rest to
    ``direct_factory`` (None: there is none, a direct endpoint is a TransportError)."""
    def factory(endpoint: str) -> HopTransport:
        if endpoint.startswith(RELAYED_SCHEME):
            return RelayedTransport.to_peer(portal, host, ID.from_base58(endpoint[len(RELAYED_SCHEME):]))
        if direct_factory is None:
            raise TransportError(f"{endpoint} is not a relayed endpoint and there is no direct transport")
        return direct_factory(endpoint)
    return factory
