"""relay.bridge: relayed frames to a real gRPC Session server through the grpc.aio link thread."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import trio

from relay.bridge import BRIDGE_QUEUE_FRAMES, GRPC_OPTIONS, SESSION_METHOD, WorkerLink, WorkerSession
from relay.errors import WorkerUnavailable
from tests._relay_helpers import ECHO_PREFIX, echo_worker


def _server(session):
    handler = grpc.method_handlers_generic_handler(SESSION_METHOD.split("/")[1], {
        "Session": grpc.stream_stream_rpc_method_handler(session)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_frames_go_through_in_order_and_the_half_close_ends_the_session():
    async def main(target):
        link = WorkerLink(target)
        try:
            async with WorkerSession.open(link) as worker:
                bodies = [b"open", b"x" * 70_000, b"step"]
                for body in bodies:                 # one at a time, like decode steps
                    await worker.send(body)
                    assert await worker.receive() == ECHO_PREFIX + body
                for body in bodies * 3:             # pipelined: credits bound what waits
                    await worker.send(body)
                    assert await worker.receive() == ECHO_PREFIX + body
                worker.done_writing()
                assert await worker.receive() is None
                with pytest.raises(WorkerUnavailable):
                    await worker.send(b"late")
        finally:
            link.close()

    with echo_worker() as target:
        trio.run(main, target)


def test_a_session_that_the_worker_aborts_fails_with_a_typed_error():
    def session(request_iterator, context):
        next(request_iterator)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "kv budget")

    async def main(target):
        link = WorkerLink(target)
        try:
            async with WorkerSession.open(link) as worker:
                await worker.send(b"open")
                with pytest.raises(WorkerUnavailable, match="RESOURCE_EXHAUSTED"):
                    await worker.receive()
        finally:
            link.close()

    server, target = _server(session)
    try:
        trio.run(main, target)
    finally:
        server.stop(grace=None)


def test_no_worker_listening_is_worker_unavailable_and_a_closed_link_too():
    async def main():
        link = WorkerLink("127.0.0.1:9")          # discard port: nothing serves gRPC there
        try:
            async with WorkerSession.open(link) as worker:
                await worker.send(b"open")
                with trio.fail_after(30), pytest.raises(WorkerUnavailable, match="UNAVAILABLE"):
                    await worker.receive()
        finally:
            link.close()
        with pytest.raises(WorkerUnavailable, match="closed"):
            async with WorkerSession.open(link):
                pass

    trio.run(main)


def test_cancel_reaches_the_worker_and_leaving_the_session_does_not_hang():
    cancelled = threading.Event()
    first = threading.Event()

    def session(request_iterator, context):
        context.add_callback(cancelled.set)
        for body in request_iterator:
            first.set()
            yield body

    async def main(target):
        link = WorkerLink(target)
        try:
            with trio.fail_after(20):
                async with WorkerSession.open(link) as worker:
                    await worker.send(b"open")
                    assert await worker.receive() == b"open"
                    worker.cancel()
            assert await trio.to_thread.run_sync(cancelled.wait, 10)
        finally:
            link.close()

    server, target = _server(session)
    try:
        trio.run(main, target)
    finally:
        server.stop(grace=None)


def test_a_worker_that_stops_reading_stops_the_sender_at_the_bound():
    release = threading.Event()

    def session(request_iterator, context):
        release.wait(20)                          # reads nothing until released
        yield from request_iterator

    async def main(target):
        link = WorkerLink(target)
        try:
            async with WorkerSession.open(link) as worker:
                sent = 0
                with trio.move_on_after(3):
                    while sent < 10_000:
                        await worker.send(b"y" * 1_000_000)
                        sent += 1
                # gRPC's own flow-control windows hold a few frames; ours hold BRIDGE_QUEUE_FRAMES.
                assert sent < 64, sent
                release.set()
                worker.cancel()
        finally:
            link.close()

    server, target = _server(session)
    try:
        trio.run(main, target)
    finally:
        release.set()
        server.stop(grace=None)


def test_closing_the_link_under_a_live_session_fails_it_with_a_typed_error():
    async def main(target):
        link = WorkerLink(target)
        async with WorkerSession.open(link) as worker:
            await worker.send(b"open")
            assert await worker.receive() == ECHO_PREFIX + b"open"
            await trio.to_thread.run_sync(link.close)
            with trio.fail_after(10), pytest.raises(WorkerUnavailable, match="closed"):
                await worker.receive()

    with echo_worker() as target:
        trio.run(main, target)


def test_the_bridge_refuses_a_non_loopback_worker():
    with pytest.raises(ValueError, match="loopback"):
        WorkerLink("10.0.0.1:5000")
    assert BRIDGE_QUEUE_FRAMES >= 1
