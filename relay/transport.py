"""Relayed hops: session frames over a libp2p stream, and the serving-side handler.

One relayed hop = one libp2p stream with protocol ``SESSION_PROTOCOL`` on the
end-to-end connection (Noise between the two END peers, through the relay's
circuit; see relay/client.py). The stream carries exactly the serialized
SessionRequest (dialer -> server) and SessionResponse (server -> dialer) bytes
a gRPC hop carries, each length-prefixed by proto.frames: the bytes of a hop
do not depend on its transport.

    dialer: RelayedFrameChannel.send(request bytes) ──▶ stream ──▶ (relay: ciphertext)
    server: RelayedSessionServer._handle(stream) ──▶ WorkerSession (relay/bridge.py: one
            thread hop into the node's grpc.aio loop) ──▶ local gRPC Session stream of
            this node's own worker ──▶ responses
            ──▶ framed back on the same stream

The server parses one frame only: the first; when it is a SessionOpen it
stamps ``relayed_peer_id`` with the Noise-authenticated peer id of the
circuit (whatever the peer put there) so the worker binds the session to that
peer (shard/sessions.py: ownership and per-peer quota). A first frame that is
not a parseable SessionOpen goes on unchanged: the worker, parsing with the
same proto.frames.parse_request, refuses it and ends the stream. Every other
frame is forwarded unparsed; the worker parses
them (proto.frames.parse_request), so the session state machine is the
worker's one core for both transports.

Bounds: a channel holds at most one partial frame (FramedStream.read_size),
whose bytes are first taken from the node-wide ByteBudget; between the stream
and the worker at most ``bridge.BRIDGE_QUEUE_FRAMES`` frames wait per direction;
at most ``MAX_RELAYED_SESSIONS`` sessions run at once (more are reset). A
peer's bad framing ends only its own session (its gRPC call is cancelled).
"""
from __future__ import annotations

import logging

import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF

from proto.errors import ProtocolError, ProtocolViolation
from proto.frames import parse_request
from relay import trace
from relay.bridge import WorkerLink, WorkerSession
from relay.errors import RelayUnreachable, WorkerUnavailable
from relay.framing import RELAYED_MAX_FRAME_BYTES, ByteBudget, FramedStream
from relay.local_link import UNIX_SCHEME, UnixWorkerLink, UnixWorkerSession

log = logging.getLogger(__name__)

__all__ = ["SESSION_PROTOCOL", "RelayedFrameChannel", "open_session_channel", "RelayedSessionServer",
           "MAX_RELAYED_SESSIONS"]

SESSION_PROTOCOL = TProtocol("/meshd/shard-session/1")

# Relayed sessions one node serves at once: each holds a worker gRPC stream
# and a coroutine in the bridge's loop; the worker's own KV budget admits far
# fewer real sessions, so 16 only stops a peer from opening streams to tie up the worker.
MAX_RELAYED_SESSIONS = 16
# Opening the session stream is one multistream negotiation on a live connection.
OPEN_STREAM_TIMEOUT_S = 10.0


class RelayedFrameChannel:
    """Send and receive whole frame bodies on one libp2p stream (either side)."""

    def __init__(self, stream, *, budget: ByteBudget | None = None,
                 max_frame_bytes: int = RELAYED_MAX_FRAME_BYTES, side: str = "") -> None:
        self._stream = stream
        self._side = side       # "e" (entry) / "h" (home) names this end in relay.trace marks
        self._core = FramedStream(max_frame_bytes)
        self._budget = budget
        self._held = 0          # budget bytes taken for the partial frame being read
        self._send_lock = trio.Lock()

    @property
    def counters(self):
        return self._core.counters

    async def send(self, body: bytes) -> None:
        data = self._core.frame(body)
        async with self._send_lock:
            try:
                await self._stream.write(data)
            except Exception as exc:  # reset / closed connection
                raise RelayUnreachable(f"relayed stream closed while sending: {exc}") from exc
        if trace.ENABLED and self._side:
            trace.mark(self._side + ".write_done")

    async def receive(self) -> bytes | None:
        """The next frame body; None when the far side ended the stream.

        py-libp2p reports a reset by the far side as end-of-stream too, so None
        without a terminal ShardStatus first means the hop failed (the driver's rule).
        ProtocolError for bad framing; RelayUnreachable when a local read fails."""
        while True:
            body = self._core.next_frame()
            if body is not None:
                self._give_back()
                if trace.ENABLED and self._side:
                    trace.mark(self._side + ".read_done")
                return body
            want = self._core.read_size()
            try:
                data = await self._stream.read(want)
            except StreamEOF:
                data = b""
            except Exception as exc:
                raise RelayUnreachable(f"relayed stream reset: {exc}") from exc
            if not data:
                self._give_back()
                self._core.receive_eof()
                return None
            self._core.receive_data(data)
            self._take_for_head()

    def _take_for_head(self) -> None:
        """Charge the node budget for a frame as soon as its length is known."""
        size = self._core.head_frame_bytes
        if self._budget is None or self._held or size is None:
            return
        self._budget.take(size)     # LimitExceeded before the body is read
        self._held = size

    def _give_back(self) -> None:
        if self._budget is not None and self._held:
            self._budget.give_back(self._held)
            self._held = 0

    async def close(self) -> None:
        """Half-close our sending side (the peer sees a clean end)."""
        try:
            await self._stream.close()
        except Exception:  # already gone
            pass

    async def reset(self) -> None:
        self._give_back()
        try:
            await self._stream.reset()
        except Exception:  # already gone
            pass


async def open_session_channel(host, peer_id) -> RelayedFrameChannel:
    """A new session stream to ``peer_id`` over an existing (possibly relayed) connection."""
    with trio.move_on_after(OPEN_STREAM_TIMEOUT_S):
        try:
            stream = await host.new_stream(peer_id, [SESSION_PROTOCOL])
        except Exception as exc:
            raise RelayUnreachable(f"cannot open a session stream to {peer_id}: {exc}") from exc
        return RelayedFrameChannel(stream, side="e")
    raise RelayUnreachable(f"no session stream to {peer_id} within {OPEN_STREAM_TIMEOUT_S:g} s")


class RelayedSessionServer:
    """Serves ``SESSION_PROTOCOL`` streams by forwarding them to the local worker."""

    def __init__(self, worker_target: str, *, max_sessions: int = MAX_RELAYED_SESSIONS,
                 budget: ByteBudget | None = None) -> None:
        # ``unix:/path``: the worker's frame socket, forwarded inside trio; else loopback gRPC.
        if worker_target.startswith(UNIX_SCHEME):
            self._link, self._session_cls = UnixWorkerLink(worker_target), UnixWorkerSession
        else:
            self._link, self._session_cls = WorkerLink(worker_target), WorkerSession
        self.max_sessions = max_sessions
        self.budget = budget or ByteBudget()
        self.active = 0
        self.served = 0
        self.refused = 0

    def attach(self, host) -> None:
        host.set_stream_handler(SESSION_PROTOCOL, self._handle)

    def close(self) -> None:
        self._link.close()

    async def _handle(self, stream) -> None:
        if self.active >= self.max_sessions:
            self.refused += 1
            await _reset(stream)
            return
        self.active += 1
        channel = RelayedFrameChannel(stream, budget=self.budget, side="h")
        try:
            await self._serve(channel, _peer(stream))
            self.served += 1
        except* (ProtocolError, RelayUnreachable, WorkerUnavailable) as group:
            # The peer's bad framing, a vanished peer or our worker: this session only.
            log.info("relayed session from %s ended: %s", _peer(stream), group.exceptions[0])
            await channel.reset()
        finally:
            self.active -= 1

    async def _serve(self, channel: RelayedFrameChannel, peer_id: str) -> None:
        first = await channel.receive()
        if first is None:
            return
        opening = stamp_relayed_peer(first, peer_id)
        async with self._session_cls.open(self._link) as worker:
            await worker.send(opening)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._uplink, channel, worker)
                while (body := await worker.receive()) is not None:
                    await channel.send(body)
                await channel.close()
                nursery.cancel_scope.cancel()   # the worker ended the session

    @staticmethod
    async def _uplink(channel: RelayedFrameChannel, worker: WorkerSession) -> None:
        try:
            while (body := await channel.receive()) is not None:
                await worker.send(body)
            worker.done_writing()
        except BaseException:
            worker.cancel()     # the worker sees a cancelled stream and drops the session
            raise

    def snapshot(self) -> dict:
        return {"sessions_active": self.active, "sessions_served": self.served,
                "sessions_refused": self.refused, "buffered_bytes": self.budget.in_use}


def stamp_relayed_peer(body: bytes, peer_id: str) -> bytes:
    """The first frame of a relayed session: a SessionOpen gets ``relayed_peer_id`` = the circuit's
    authenticated peer; anything else is returned as it is (the worker refuses it)."""
    try:
        request = parse_request(body)
    except ProtocolError:
        return body
    if request.WhichOneof("kind") != "open":
        return body
    if not peer_id or peer_id == "?":
        raise ProtocolViolation("the circuit's peer id is unknown; refusing the session")
    request.open.relayed_peer_id = peer_id
    return request.SerializeToString()


def _peer(stream) -> str:
    try:
        return str(stream.muxed_conn.peer_id)
    except Exception:
        return "?"


async def _reset(stream) -> None:
    try:
        await stream.reset()
    except Exception:  # already gone
        pass
