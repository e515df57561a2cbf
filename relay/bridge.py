"""Trio <-> gRPC bridge: one Session stream to this node's own worker, as raw bytes.

The worker serves ShardRuntime over plaintext gRPC on loopback. A relayed
session is forwarded to it as the SAME serialized frames: the gRPC method is
called with identity (de)serializers, so bytes go in and come out untouched
and the worker's parser is the only one that looks at them.

Threads (grpcio's asyncio API cannot run inside trio, so it gets one thread):

    trio  send(body) ─ Credits ─ loop.call_soon_threadsafe ─▶ asyncio: call.write(body)
    trio  receive()  ◀─ trio memory channel ◀─ token.run_sync_soon ─ asyncio: call.read()

``WorkerLink`` owns one asyncio loop thread and one grpc.aio channel per
worker target, shared by every relayed session of a node (``WorkerSession``:
one coroutine per session in that loop). A frame crosses threads ONCE per
direction: no request-iterator thread, no response pump thread, no wait for
the other side to acknowledge (the sync-API bridge this replaces woke ~5
threads per frame; see the relay benchmark's breakdown). Bounds: at most
``BRIDGE_QUEUE_FRAMES`` frames in flight per direction (``relay.handoff.Credits``;
the side that gives a credit back wakes the other only when it is waiting).
``cancel()`` cancels the gRPC call (the worker drops the session); leaving
``WorkerSession.open`` always cancels an unfinished call and waits (bounded)
for its coroutine to end.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import grpc.aio
import trio

from proto import shard_runtime_pb2 as pb
from proto.limits import MAX_FRAME_BYTES
from relay import trace
from relay.errors import WorkerUnavailable
from relay.handoff import Credits

__all__ = ["SESSION_METHOD", "BRIDGE_QUEUE_FRAMES", "GRPC_OPTIONS", "WorkerLink", "WorkerSession",
           "open_worker_channel", "check_loopback"]

SESSION_METHOD = f"/{pb.DESCRIPTOR.services_by_name['ShardRuntime'].full_name}/Session"
# Frames waiting between trio and gRPC per direction: 2 lets the next decode
# step or prefill chunk queue while one is in flight, and no more.
BRIDGE_QUEUE_FRAMES = 2
# Starting or stopping the link's loop thread and channel: local work only.
LINK_START_TIMEOUT_S = 10.0
LINK_STOP_TIMEOUT_S = 10.0
# A session's coroutine ends promptly once its call is cancelled; bounded wait for it.
SESSION_END_TIMEOUT_S = 5.0
_END = object()

GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_FRAME_BYTES),
                ("grpc.max_receive_message_length", MAX_FRAME_BYTES)]


def check_loopback(target: str) -> str:
    """The worker bridge speaks plaintext gRPC: only to a loopback address (the worker's rule)."""
    host = target.rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the worker bridge speaks plaintext gRPC: {target} must be a loopback address")
    return target


def open_worker_channel(target: str) -> grpc.Channel:
    """A plaintext sync channel to the node's own worker (unary calls); loopback only."""
    return grpc.insecure_channel(check_loopback(target), options=GRPC_OPTIONS)


class WorkerLink:
    """An asyncio loop thread with a grpc.aio channel to one worker; ``close()`` ends both."""

    def __init__(self, target: str) -> None:
        self.target = check_loopback(target)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="relay-worker-link", daemon=True)
        self._thread.start()
        self.channel: grpc.aio.Channel = asyncio.run_coroutine_threadsafe(
            self._open_channel(), self.loop).result(LINK_START_TIMEOUT_S)

    async def _open_channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.target, options=GRPC_OPTIONS)

    async def _shutdown(self) -> None:
        """Cancel the sessions still running (their calls with them), then close the channel."""
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self.channel.close()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(LINK_STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a channel that fails to close is dropped with its loop
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(LINK_STOP_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


class WorkerSession:
    """One open Session call to the worker; use through ``WorkerSession.open``."""

    def __init__(self, link: WorkerLink) -> None:
        self._link = link
        self._token = trio.lowlevel.current_trio_token()
        self._send_resp, self._recv_resp = trio.open_memory_channel(BRIDGE_QUEUE_FRAMES + 1)  # + outcome
        self._up: Credits[trio.Event] = Credits(BRIDGE_QUEUE_FRAMES)      # requests trio -> gRPC
        self._down: Credits[asyncio.Event] = Credits(BRIDGE_QUEUE_FRAMES)  # responses gRPC -> trio
        self._requests: asyncio.Queue = asyncio.Queue()   # binds to the link's loop on first use; bounded by _up
        self._ended = trio.Event()
        self._closed_writing = False
        self._cancelled = False
        self._future: concurrent.futures.Future[None] | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, link: WorkerLink) -> AsyncIterator[WorkerSession]:
        session = cls(link)
        coro = session._run()
        try:
            session._future = asyncio.run_coroutine_threadsafe(coro, link.loop)
        except RuntimeError as exc:     # the link's loop is closed
            coro.close()
            raise WorkerUnavailable(f"the bridge to worker {link.target} is closed") from exc
        try:
            yield session
        finally:
            session.cancel()        # no-op when the call already finished
            with trio.move_on_after(SESSION_END_TIMEOUT_S) as scope:
                scope.shield = True
                await session._ended.wait()

    # ------------------------------------------------------------ asyncio side

    async def _run(self) -> None:
        call = self._link.channel.stream_stream(SESSION_METHOD)()
        writer = asyncio.ensure_future(self._write_all(call))
        outcome: object = None
        try:
            while True:
                while (waiter := self._down.take(asyncio.Event)) is not None:
                    await waiter.wait()
                body = await call.read()
                if body is grpc.aio.EOF:
                    break
                trace.mark("h.pump_got")
                self._to_trio(body)
        except asyncio.CancelledError:
            call.cancel()
            if not self._cancelled:     # not our cancel(): the link is closing under the session
                outcome = WorkerUnavailable(f"the bridge to worker {self._link.target} closed")
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                outcome = WorkerUnavailable(f"worker session failed: {exc.code().name}: {exc.details()}")
        except Exception as exc:  # noqa: BLE001 - anything else from grpc: this session's worker failed
            outcome = WorkerUnavailable(f"worker session failed: {exc!r}")
        finally:
            writer.cancel()
            self._to_trio(outcome, final=True)

    async def _write_all(self, call) -> None:
        try:
            while (body := await self._requests.get()) is not _END:
                trace.mark("h.iter_yield")
                await call.write(body)
                if (waiter := self._up.give()) is not None:
                    self._in_trio(waiter.set)
            await call.done_writing()
        except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.UsageError):
            pass    # the reader side reports the call's outcome

    def _to_trio(self, item, *, final: bool = False) -> None:
        def deliver() -> None:
            trace.mark("h.trio_got")
            try:
                self._send_resp.send_nowait(item)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass    # the trio side is gone (session over); a final marker fits by construction
            if final:
                self._ended.set()
        self._in_trio(deliver)

    def _in_trio(self, fn) -> None:
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass

    # --------------------------------------------------------------- trio side

    async def send(self, body: bytes) -> None:
        """Queue one request frame for the worker (waits while BRIDGE_QUEUE_FRAMES are queued)."""
        if self._closed_writing:
            raise WorkerUnavailable("worker session already finished")
        while (waiter := self._up.take(trio.Event)) is not None:
            await waiter.wait()
        self._in_link(self._requests.put_nowait, body)

    def _in_link(self, fn, *args) -> None:
        try:
            self._link.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError as exc:     # the link's loop is closed
            raise WorkerUnavailable(f"the bridge to worker {self._link.target} is closed") from exc

    def done_writing(self) -> None:
        """The dialer finished sending: half-close the gRPC request stream."""
        if not self._closed_writing:
            self._closed_writing = True
            self._in_link(self._requests.put_nowait, _END)

    async def receive(self) -> bytes | None:
        """The next response frame; None when the worker ended the stream normally."""
        item = await self._recv_resp.receive()
        if item is None or isinstance(item, WorkerUnavailable):
            if isinstance(item, WorkerUnavailable):
                raise item
            return None
        if (waiter := self._down.give()) is not None:
            self._in_link(waiter.set)
        return item

    def cancel(self) -> None:
        self._cancelled = True
        self._closed_writing = True
        if self._future is not None and not self._future.done():
            self._future.cancel()       # thread-safe: cancels the task in the link's loop
