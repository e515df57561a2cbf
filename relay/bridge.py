"""Trio <-> gRPC bridge: one Session stream to this node's own worker, as raw bytes.

The worker serves ShardRuntime over plaintext gRPC on loopback. A relayed
session is forwarded to it as the SAME serialized frames: the gRPC method is
called with identity (de)serializers, so bytes go in and come out untouched
and the worker's parser is the only one that looks at them.

Threads and queues (grpcio's sync API keeps it out of the trio loop):

    trio  send(body) ── credit (trio.Semaphore) ──▶ queue.Queue ──▶ grpc request iterator
    trio  receive()  ◀── trio memory channel (BRIDGE_QUEUE_FRAMES) ◀── pump thread
                                                  (iterates the gRPC response stream)

Both directions hold at most BRIDGE_QUEUE_FRAMES frames: the sender waits for
a credit that the request iterator returns once gRPC took the frame, and the
pump thread blocks in ``trio.from_thread.run`` until trio takes a response.
``cancel()`` cancels the gRPC call (the worker drops the session); leaving
``WorkerSession.open`` always cancels an unfinished call and joins the pump.
"""
from __future__ import annotations

import queue
from contextlib import asynccontextmanager
from typing import AsyncIterator

import grpc
import trio

from proto import shard_runtime_pb2 as pb
from proto.limits import MAX_FRAME_BYTES
from relay import trace
from relay.errors import WorkerUnavailable

__all__ = ["SESSION_METHOD", "BRIDGE_QUEUE_FRAMES", "open_worker_channel", "WorkerSession"]

SESSION_METHOD = f"/{pb.DESCRIPTOR.services_by_name['ShardRuntime'].full_name}/Session"
# Frames waiting between trio and gRPC per direction: 2 lets the next decode
# step or prefill chunk queue while one is in flight, and no more.
BRIDGE_QUEUE_FRAMES = 2
# Threads used by all bridges of a node: two per session (pump + grpc's
# request consumer) for MAX_RELAYED_SESSIONS sessions, plus slack.
BRIDGE_THREADS = 40
_LIMITER: trio.lowlevel.RunVar = trio.lowlevel.RunVar("meshd_relay_bridge_limiter")
_END = object()

GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_FRAME_BYTES),
                ("grpc.max_receive_message_length", MAX_FRAME_BYTES)]


def open_worker_channel(target: str) -> grpc.Channel:
    """A plaintext channel to the node's own worker; loopback only (the worker's rule)."""
    host = target.rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the worker bridge speaks plaintext gRPC: {target} must be a loopback address")
    return grpc.insecure_channel(target, options=GRPC_OPTIONS)


def _limiter() -> trio.CapacityLimiter:
    """One limiter per trio run (a RunVar: tests and portals start several runs)."""
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(BRIDGE_THREADS)
        _LIMITER.set(limiter)
        return limiter


class WorkerSession:
    """One open Session call to the worker; use through ``WorkerSession.open``."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.Queue = queue.Queue(maxsize=BRIDGE_QUEUE_FRAMES + 1)  # +1: end marker
        self._credits = trio.Semaphore(BRIDGE_QUEUE_FRAMES)
        self._token = trio.lowlevel.current_trio_token()
        self._send_resp, self._recv_resp = trio.open_memory_channel(BRIDGE_QUEUE_FRAMES)
        self._call = channel.stream_stream(SESSION_METHOD)(self._request_iter())
        self._closed_writing = False

    @classmethod
    @asynccontextmanager
    async def open(cls, channel: grpc.Channel) -> AsyncIterator["WorkerSession"]:
        session = cls(channel)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session._run_pump)
                try:
                    yield session
                finally:
                    session.cancel()   # no-op when the call already finished
        finally:
            session._call.cancel()

    def _request_iter(self):
        while True:
            item = self._requests.get()
            if item is _END:
                return
            try:
                self._token.run_sync_soon(self._credits.release)
            except trio.RunFinishedError:
                return
            trace.mark("h.iter_yield")
            yield item

    async def _run_pump(self) -> None:
        await trio.to_thread.run_sync(self._pump, limiter=_limiter(), abandon_on_cancel=True)

    def _pump(self) -> None:
        outcome: object = None
        try:
            for body in self._call:
                trace.mark("h.pump_got")
                trio.from_thread.run(self._send_resp.send, body, trio_token=self._token)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                outcome = WorkerUnavailable(f"worker session failed: {exc.code().name}: {exc.details()}")
        except (trio.RunFinishedError, trio.Cancelled):
            return
        try:
            trio.from_thread.run(self._send_resp.send, outcome, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def send(self, body: bytes) -> None:
        """Queue one request frame for the worker (waits while BRIDGE_QUEUE_FRAMES are queued)."""
        if self._closed_writing:
            raise WorkerUnavailable("worker session already finished")
        await self._credits.acquire()
        self._requests.put_nowait(body)

    def done_writing(self) -> None:
        """The dialer finished sending: half-close the gRPC request stream."""
        if not self._closed_writing:
            self._closed_writing = True
            self._requests.put_nowait(_END)

    async def receive(self) -> bytes | None:
        """The next response frame; None when the worker ended the stream normally."""
        item = await self._recv_resp.receive()
        if isinstance(item, WorkerUnavailable):
            raise item
        return item

    def cancel(self) -> None:
        self._call.cancel()
        if not self._closed_writing:
            self._closed_writing = True
            try:
                self._requests.put_nowait(_END)
            except queue.Full:  # the request iterator is gone already
                pass
