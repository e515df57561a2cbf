"""The control API's streaming ops (``generate``): events stream as JSON lines; a client leaving cancels."""
from __future__ import annotations

import json
import socket

import pytest
import trio

from meshd.daemon.control import serve_control, stream_events
from meshd.errors import ControlUnavailable
from tests.conftest import wait_until


async def _status(request: dict) -> dict:
    return {"status": True}


def test_events_stream_until_done_and_errors_are_typed(tmp_path):
    path = tmp_path / "c.sock"

    async def streamer(request: dict, send) -> None:
        if request.get("prompt") == "boom":
            raise ValueError("no route")
        for i in range(3):
            await send({"text": f"t{i}", "token": i})
        await send({"done": True, "tokens": [0, 1, 2]})

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_control(path, _status, stream_handler=streamer,
                                                                   task_status=task_status))
            events = await trio.to_thread.run_sync(lambda: list(stream_events(path, {"op": "generate", "prompt": "x"})))
            with pytest.raises(ControlUnavailable, match="ValueError: no route"):
                await trio.to_thread.run_sync(lambda: list(stream_events(path, {"op": "generate", "prompt": "boom"})))
            nursery.cancel_scope.cancel()
        return events

    events = trio.run(main)
    assert [e.get("text") for e in events[:3]] == ["t0", "t1", "t2"] and events[-1]["done"]


def test_a_client_that_leaves_cancels_the_work(tmp_path):
    path = tmp_path / "c.sock"
    seen = {}

    async def streamer(request: dict, send) -> None:
        try:
            await send({"text": "first"})
            await trio.sleep_forever()
        finally:
            seen["cancelled"] = True

    def client() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(path))
            sock.sendall(json.dumps({"op": "generate", "prompt": "x"}).encode() + b"\n")
            assert json.loads(sock.recv(4096).split(b"\n")[0])["text"] == "first"
        # closing the socket here is the client going away

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_control(path, _status, stream_handler=streamer,
                                                                   task_status=task_status))
            await trio.to_thread.run_sync(client)
            await wait_until(lambda: "cancelled" in seen, 10, "the stream handler's cancellation")
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen["cancelled"]
