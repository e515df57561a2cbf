"""Relayed hops for synchronous callers (the route driver): a proto.hop_transport.HopTransport.

The route driver (meshd/generate/driver.py) speaks to every hop through a
HopTransport: ``open_session()`` gives a stream to ``send`` request bodies on
and ``receive`` response bodies from (raw bytes both ways), ``cancel()`` it,
``close()`` the transport. A relayed hop is one more implementation:

    driver thread ─ send ─ run_sync_soon ─▶ trio writer task ─▶ stream
    driver thread ◀── receive: Inbox.get() ◀──────────────────── trio reader task ◀─ stream

``TrioPortal`` runs one trio loop (the libp2p host) in a background thread
and lets plain threads call into it. A stream holds at most SEND_FRAMES
requests and CALL_QUEUE_FRAMES responses between the caller's threads and the
libp2p stream; a frame crosses threads once (see ``RelayedStream``). Only
``portal.run`` is needed from a portal, so the daemon's own portal works too.

Endpoints: ``RELAYED_SCHEME + <peer id>`` names a relayed hop; a
``transport_factory`` from ``relayed_transport_factory`` sends those through
the portal and everything else to the direct factory it wraps.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable

import trio
from libp2p.peer.id import ID

from proto.errors import ProtocolError
from proto.hop_transport import HopTransport, TransportError, TransportStatus, Unary
from relay import trace
from relay.errors import RelayError, RelayUnreachable
from relay.handoff import Inbox
from relay.transport import RelayedFrameChannel, open_session_channel

__all__ = ["TrioPortal", "RelayedTransport", "RelayedStream", "relayed_error", "relayed_transport_factory",
           "RELAYED_SCHEME"]

RELAYED_SCHEME = "p2p:"
# Joining the portal thread after cancel: the host closes its listeners first.
PORTAL_STOP_TIMEOUT_S = 30.0
# Frames of one relayed stream waiting between the libp2p stream and the receiving thread: 2
# lets the next response queue while one is being read, like the bridge.
CALL_QUEUE_FRAMES = 2
# Requests handed to trio, not yet written: the hop link's own bound (its credits bound it first).
SEND_FRAMES = 16
# How often a sender blocked on a full queue checks whether its stream ended.
PUMP_POLL_S = 0.5
_END = object()


class TrioPortal:
    """A trio loop in a daemon thread running ``setup(task_status)`` until ``stop()``."""

    def __init__(self, setup: Callable[..., Awaitable[None]]) -> None:
        self._setup = setup
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scopes: list[trio.CancelScope] = []   # the writer's and the reader's
        self.value = None
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


def relayed_error(cause: BaseException) -> TransportError:
    """How a relayed hop's failure reaches the driver: the transport is unavailable."""
    return TransportError(f"relayed hop: {cause}", TransportStatus.UNAVAILABLE)


class RelayedStream:
    """One Session stream over a relayed libp2p stream (a proto.hop_transport.HopStream).

    Two tasks in the portal's trio loop own the libp2p stream for the session's life
    (a writer fed by a memory channel, a reader filling an ``Inbox``); they end at the
    stream's end, on a failure, or when ``cancel()`` cancels their scope. Each frame
    crosses threads once: ``send`` hands a request to trio with ``run_sync_soon`` (no
    wait for the write), the reader hands a response to the receiving thread through
    the inbox (no round trip into trio per ``receive``). Credits bound both
    directions (SEND_FRAMES, CALL_QUEUE_FRAMES).
    """

    def __init__(self, portal: TrioPortal, channel: RelayedFrameChannel) -> None:
        self._portal, self._channel = portal, channel
        self._done = False
        self._sent_all = False      # we half-closed: an end of stream is now the normal end
        self._inbox: Inbox = Inbox(CALL_QUEUE_FRAMES)
        self._up = threading.Semaphore(SEND_FRAMES)   # requests handed to trio, not yet written
        self._scopes: list[trio.CancelScope] = []   # the writer's and the reader's
        try:
            self._token, self._to_writer = portal.run(self._start)
        except RelayError as exc:       # the loop has stopped: the driver sees a failed hop
            raise relayed_error(exc) from exc

    # ------------------------------------------------------------- trio side

    async def _start(self):
        """In the portal's loop: the writer and reader tasks, each under a scope ``cancel()`` cancels."""
        send, receive = trio.open_memory_channel(SEND_FRAMES + 1)   # + the end marker
        # Scopes exist before the tasks run, so a cancel() that comes first still reaches them.
        self._scopes = [trio.CancelScope(), trio.CancelScope()]
        trio.lowlevel.spawn_system_task(self._guarded, self._scopes[0], self._write_all, receive,
                                        name="relayed-call-writer")
        trio.lowlevel.spawn_system_task(self._guarded, self._scopes[1], self._read_all, name="relayed-call-reader")
        return trio.lowlevel.current_trio_token(), send

    async def _guarded(self, scope: trio.CancelScope, afn, *args) -> None:
        """A system task must never raise: failures go to the receiver through the inbox."""
        with scope:
            try:
                await afn(*args)
            except Exception as exc:  # noqa: BLE001 - RelayError, ProtocolError, or a library surprise
                self._stop_tasks()          # the other task stops too
                cause = exc if isinstance(exc, (RelayError, ProtocolError)) else RelayUnreachable(repr(exc))
                self._inbox.put(relayed_error(cause))
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
                self._inbox.put(relayed_error(RelayUnreachable("the libp2p loop has stopped")))
            raise

    # ----------------------------------------------------------- sending threads

    def send(self, body: bytes, timeout_s: float | None = None) -> None:
        """Hand one request to the writer task (in the caller's thread); nothing once the stream is over."""
        trace.mark("e.pump_got")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._up.acquire(timeout=PUMP_POLL_S):
            if self._done:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportError(f"the relayed stream took no request for {timeout_s:.0f} s",
                                     TransportStatus.DEADLINE_EXCEEDED)
        if self._done:
            return
        try:
            self._token.run_sync_soon(self._hand_over, body)
        except trio.RunFinishedError:
            self._inbox.put(relayed_error(RelayUnreachable("the libp2p loop has stopped")))

    def close_send(self) -> None:
        if self._done:
            return
        try:
            self._token.run_sync_soon(self._hand_over, _END)
        except trio.RunFinishedError:
            self._inbox.put(relayed_error(RelayUnreachable("the libp2p loop has stopped")))

    def _hand_over(self, item) -> None:
        trace.mark("e.trio_got")
        try:
            self._to_writer.send_nowait(item)   # never full: bounded by self._up
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass    # the writer is gone; the reader reports why

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

    def __init__(self, portal, open_stream: Callable[[], Awaitable[RelayedFrameChannel]], *, conn=None) -> None:
        self._portal, self._open_stream = portal, open_stream
        self.conn = conn        # the one connection its streams open on, when it has one

    @classmethod
    def to_peer(cls, portal, host, peer_id: ID) -> RelayedTransport:
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


def relayed_transport_factory(portal: TrioPortal, host, direct_factory: Callable[[str], HopTransport] | None
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
