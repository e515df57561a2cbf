"""The local control API: a private unix socket, bounded JSON requests."""
from __future__ import annotations

import socket
import stat

import pytest
import trio

from meshd.daemon.control import MAX_REQUEST_BYTES, request, serve_control
from meshd.errors import ControlUnavailable, DaemonError


async def _handler(req: dict) -> dict:
    if req["op"] == "status":
        raise RuntimeError("boom")
    return {"pong": True}


def _raw(path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(path))
        try:
            s.sendall(data)
        except BrokenPipeError:
            pass
        return s.makefile("rb").readline()


def test_control_socket_private_bounded_and_robust(tmp_path):
    path = tmp_path / "control.sock"

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_control, path, _handler)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert (await trio.to_thread.run_sync(request, path, "ping"))["pong"] is True
            for data, err in ((b"not json\n", b"not JSON"), (b'{"op": "rm -rf"}\n', b"op must be"),
                              (b"[1]\n", b"op must be"), (b"x" * (MAX_REQUEST_BYTES + 10), b"too large")):
                reply = await trio.to_thread.run_sync(_raw, path, data)
                assert err in reply
            # a failing handler answers with an error and the server keeps serving
            with pytest.raises(ControlUnavailable, match="boom"):
                await trio.to_thread.run_sync(request, path, "status")
            assert (await trio.to_thread.run_sync(request, path, "ping"))["pong"] is True
            # a second daemon on the same data dir is refused
            with pytest.raises(DaemonError, match="already running"):
                await serve_control(path, _handler)
            nursery.cancel_scope.cancel()
        assert not path.exists()

    trio.run(main)


def test_control_socket_path_too_long_is_a_clear_error(tmp_path):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()

    async def main():
        await serve_control(deep / "control.sock", _handler)

    with pytest.raises(DaemonError, match="use a shorter --data-dir"):
        trio.run(main)
