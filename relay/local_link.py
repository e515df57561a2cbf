"""Trio-native link to this node's own worker over its Unix socket (no threads).

The worker serves the Session stream as length-prefixed frames on a Unix
socket (shard/edges/unix_server.py) beside gRPC. For a relayed session the home
node forwards frames from the libp2p stream to that socket inside its own
trio loop: no gRPC call, no thread hand-off, no extra copy beyond the 4-byte
prefix. ``RelayedSessionServer`` (relay/transport.py) opens one
``UnixWorkerSession`` per relayed session (open / send / receive /
done_writing / cancel): a relayed session crosses no thread in the daemon.

State: one trio socket stream and one FrameReader per session. Bounds: the
FrameReader refuses frames over MAX_FRAME_BYTES (the worker never sends
one); reads are READ_BYTES at a time and the reader is drained after each.
Any socket failure is WorkerUnavailable for this session only.
"""
from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from proto.errors import ProtocolError
from proto.frames import FrameReader, encode_frame
from proto.limits import MAX_FRAME_BYTES
from relay import trace
from relay.errors import WorkerUnavailable

__all__ = ["UNIX_SCHEME", "UnixWorkerLink", "UnixWorkerSession", "UnixFrameChannel", "open_unix_frame_channel"]

UNIX_SCHEME = "unix:"
# Bytes asked of the socket per read.
READ_BYTES = 256 * 1024
# Connecting to a local socket: immediate, or the worker is gone.
CONNECT_TIMEOUT_S = 5.0


class UnixWorkerLink:
    """Where the worker's socket is; holds nothing open between sessions."""

    def __init__(self, target: str) -> None:
        if not target.startswith(UNIX_SCHEME) or len(target) == len(UNIX_SCHEME):
            raise ValueError(f"a Unix worker target looks like unix:/path, got {target!r}")
        self.target = target
        self.path = target[len(UNIX_SCHEME):]

    def close(self) -> None:
        pass


class UnixWorkerSession:
    """One Session stream to the worker over its socket; use through ``open``."""

    def __init__(self, link: UnixWorkerLink, stream: trio.SocketStream) -> None:
        self._link = link
        self._stream = stream
        self._reader = FrameReader(MAX_FRAME_BYTES)
        self._closed_writing = False

    @classmethod
    @asynccontextmanager
    async def open(cls, link: UnixWorkerLink) -> AsyncIterator[UnixWorkerSession]:
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                stream = await trio.open_unix_socket(link.path)
        except (OSError, trio.TooSlowError) as exc:
            raise WorkerUnavailable(f"cannot reach worker at {link.target}: {exc}") from exc
        session = cls(link, stream)
        try:
            yield session
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()     # the worker sees EOF and ends the stream

    async def send(self, body: bytes) -> None:
        if self._closed_writing:
            raise WorkerUnavailable("worker session already finished")
        trace.mark("h.iter_yield")
        try:
            await self._stream.send_all(encode_frame(body))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise WorkerUnavailable(f"worker session failed: {exc!r}") from exc

    def done_writing(self) -> None:
        """The dialer finished sending: half-close, so the worker answers what it has and ends."""
        if not self._closed_writing:
            self._closed_writing = True
            self._shutdown(socket.SHUT_WR)

    def _shutdown(self, how: int) -> None:
        try:
            self._stream.socket.shutdown(how)
        except OSError:
            pass    # already closed by the worker

    async def receive(self) -> bytes | None:
        """The next response frame; None when the worker closed the stream."""
        while True:
            body = self._reader.next_frame()
            if body is not None:
                trace.mark("h.pump_got")
                trace.mark("h.trio_got")     # same loop: no hand-off on this link
                return body
            try:
                data = await self._stream.receive_some(READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise WorkerUnavailable(f"worker session failed: {exc!r}") from exc
            if not data:
                return None
            try:
                self._reader.feed(data)
            except ProtocolError as exc:    # our own worker sent a bad prefix: end this session
                raise WorkerUnavailable(f"worker sent a bad frame: {exc}") from exc

    def cancel(self) -> None:
        """Drop the stream both ways: the worker sees EOF and ends the session's stream."""
        self._closed_writing = True
        self._shutdown(socket.SHUT_RDWR)


class UnixFrameChannel:
    """A session to our own worker with the surface of ``relay.transport.RelayedFrameChannel``."""

    def __init__(self, session: UnixWorkerSession, stream: trio.SocketStream) -> None:
        self._session, self._stream = session, stream

    async def send(self, body: bytes) -> None:
        await self._session.send(body)

    async def receive(self) -> bytes | None:
        body = await self._session.receive()
        if body is None:            # the worker ended the stream: nothing more to hold open
            await self._stream.aclose()
        return body

    async def close(self) -> None:
        """Half-close: the worker answers what it has, then ends the stream."""
        self._session.done_writing()

    async def reset(self) -> None:
        self._session.cancel()
        await self._stream.aclose()


async def open_unix_frame_channel(target: str) -> UnixFrameChannel:
    """A new session stream to the worker at ``unix:/path``; WorkerUnavailable if it is gone."""
    link = UnixWorkerLink(target)
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            stream = await trio.open_unix_socket(link.path)
    except (OSError, trio.TooSlowError) as exc:
        raise WorkerUnavailable(f"cannot reach worker at {target}: {exc}") from exc
    return UnixFrameChannel(UnixWorkerSession(link, stream), stream)
