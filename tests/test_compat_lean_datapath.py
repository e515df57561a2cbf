"""The lean py-libp2p data path (dht/compat/lean_datapath.py): same bytes, same errors, fewer scheduler passes.

Real sockets and real libp2p hosts on loopback; counts and bytes, never timings."""
from __future__ import annotations

import os
import socket
import struct

import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.io.exceptions import IncompleteReadError
from libp2p.io.trio import TrioTCPStream
from libp2p.stream_muxer.yamux import yamux as Y

from dht.compat import lean_datapath as F
from meshd.benchmarks.relay_home import ECHO_PROTOCOL, echo
from relay.framing import FramedStream
from relay.transport import RelayedFrameChannel
from tests._relay_helpers import new_host, triangle


@pytest.fixture(autouse=True, scope="module")
def _host_built():
    """The host builder installs the lean data path (dht/compat/registry.py), not the import: build one first."""
    new_host()


def test_the_lean_data_path_is_installed_on_the_tested_version():
    assert F.APPLIED
    assert Y.YamuxStream.write is not F.LIBRARY["YamuxStream.write"]
    assert Y.read_exactly is not F.LIBRARY["read_exactly"]
    a, b = socket.socketpair()
    try:
        tcp = TrioTCPStream(trio.SocketStream(trio.socket.from_stdlib_socket(a)))
        assert isinstance(tcp.read_lock, F.QuickLock) and isinstance(tcp.write_lock, F.QuickLock)
    finally:
        a.close()
        b.close()
    assert F._install("0.9.0") is False          # another version: the library is left alone


# ------------------------------------------------------------------ QuickLock

async def _passes_of_a_bystander(lock, acquisitions: int) -> int:
    """How often another ready task ran while this one took ``lock`` ``acquisitions`` times."""
    ran = [0]

    async def bystander():
        while True:
            ran[0] += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bystander)
        await trio.lowlevel.checkpoint()
        before = ran[0]
        for _ in range(acquisitions):
            async with lock:
                pass
        passes = ran[0] - before
        nursery.cancel_scope.cancel()
    return passes


def test_an_uncontended_quick_lock_does_not_yield_and_a_trio_lock_does():
    assert trio.run(_passes_of_a_bystander, F.QuickLock(), 50) == 0
    # trio.Lock yields on every acquire (trio shuffles each batch, so not exactly once each).
    assert trio.run(_passes_of_a_bystander, trio.Lock(), 50) >= 25


def test_a_contended_quick_lock_waits_in_order_and_can_be_cancelled():
    async def main():
        lock, order = F.QuickLock(), []

        async def take(name):
            async with lock:
                order.append(name)
                await trio.sleep(0.01)

        async def impatient(gave_up):
            with trio.move_on_after(0.01) as scope:
                await lock.acquire()
            gave_up.append(scope.cancelled_caught)

        gave_up = []
        async with trio.open_nursery() as nursery:
            await lock.acquire()
            for name in "abc":
                nursery.start_soon(take, name)
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(impatient, gave_up)
            await trio.sleep(0.05)                       # the fourth waiter gives up meanwhile
            assert gave_up == [True]
            assert lock.locked() and lock.statistics().tasks_waiting == 3
            lock.release()
        assert order == ["a", "b", "c"] and not lock.locked()

    trio.run(main)


def test_a_pending_cancel_is_raised_at_the_quick_lock_before_it_is_taken():
    async def main():
        lock, reached = F.QuickLock(), []
        with trio.CancelScope() as scope:
            scope.cancel()
            async with lock:
                reached.append(True)
        assert scope.cancelled_caught and not reached and not lock.locked()

    trio.run(main)


def test_writes_cancelled_before_they_start_leave_the_relayed_connection_usable():
    """A writer whose scope is already cancelled must stop before Noise spends a nonce on its
    message; otherwise every later message on that connection fails to decrypt."""
    async def main():
        async with triangle() as t:
            t.home.set_stream_handler(ECHO_PROTOCOL, echo)
            stream = await t.dialer.new_stream(t.home.get_id(), [ECHO_PROTOCOL])
            channel = RelayedFrameChannel(stream)
            for size in (10, 5000, 70_000):
                with trio.CancelScope() as scope:       # straight to the libp2p stream, no lock of ours
                    scope.cancel()
                    await stream.write(FramedStream().frame(os.urandom(size)))
                assert scope.cancelled_caught
                body = os.urandom(size)
                await channel.send(body)
                with trio.fail_after(60):
                    assert await channel.receive() == body
            await channel.close()

    trio.run(main)


# ------------------------------------------------------------------ TCP read-ahead

async def _read_through(data: bytes, sizes: list[int | None]) -> tuple[bytes, int]:
    """Send ``data`` on one end of a real socket pair; read it back with these read sizes."""
    a, b = socket.socketpair()
    writer = trio.SocketStream(trio.socket.from_stdlib_socket(a))
    reader = TrioTCPStream(trio.SocketStream(trio.socket.from_stdlib_socket(b)))
    got, most_ahead = bytearray(), 0
    async with trio.open_nursery() as nursery:
        async def send():
            await writer.send_all(data)
            await writer.aclose()
        nursery.start_soon(send)
        i = 0
        while True:
            chunk = await reader.read(sizes[i % len(sizes)])
            i += 1
            most_ahead = max(most_ahead, len(reader.__dict__.get("_meshd_ahead", b"")))
            if not chunk:
                break
            got += chunk
    await reader.close()
    return bytes(got), most_ahead


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=0, max_size=200_000),
       sizes=st.lists(st.one_of(st.none(), st.integers(min_value=1, max_value=70_000)), min_size=1, max_size=8))
def test_read_ahead_returns_every_byte_in_order_and_stays_bounded(data, sizes):
    got, most_ahead = trio.run(_read_through, data, sizes)
    assert got == data
    assert most_ahead <= F.TCP_READ_AHEAD_BYTES


def test_a_two_byte_read_takes_a_whole_noise_message_in_one_recv():
    message = struct.pack(">H", 5000) + os.urandom(5000)
    calls = [0]

    async def main():
        a, b = socket.socketpair()
        reader = TrioTCPStream(trio.SocketStream(trio.socket.from_stdlib_socket(b)))
        original = reader.stream.receive_some

        async def counting(n=None):
            calls[0] += 1
            return await original(n)
        reader.stream.receive_some = counting
        a.sendall(message)
        length = struct.unpack(">H", await reader.read(2))[0]
        body = await reader.read(length)
        a.close()
        await reader.close()
        return length, body

    length, body = trio.run(main)
    assert (length, body) == (5000, message[2:]) and calls[0] == 1


# ------------------------------------------------------------------ read_exactly

class _Chunks:
    def __init__(self, chunks):
        self.chunks = list(chunks)

    async def read(self, n=None):
        if not self.chunks:
            return b""
        head = self.chunks.pop(0)
        if n is not None and len(head) > n:
            self.chunks.insert(0, head[n:])
            head = head[:n]
        return head


def test_read_exactly_assembles_partial_reads_and_keeps_the_library_error():
    assert trio.run(Y.read_exactly, _Chunks([b"ab", b"cde", b"fgh"]), 6) == b"abcdef"
    assert trio.run(Y.read_exactly, _Chunks([b"abcdef"]), 6) == b"abcdef"
    with pytest.raises(IncompleteReadError):
        trio.run(Y.read_exactly, _Chunks([b"ab", b"c"]), 6)


# ------------------------------------------------------------------ yamux frames

class _Capture:
    """The slice of a Yamux connection a stream's write touches."""

    def __init__(self):
        self.frames = []

    async def _write_frame(self, data):
        self.frames.append(bytes(data))


@pytest.mark.parametrize("size", [1, 1000, Y.MAX_MESSAGE_SIZE - Y.HEADER_SIZE, Y.MAX_MESSAGE_SIZE + 5,
                                  Y.DEFAULT_WINDOW_SIZE - 1])
def test_a_lean_write_frames_exactly_like_the_library(size):
    data = os.urandom(size)

    async def frames(write):
        conn = _Capture()
        stream = Y.YamuxStream(7, conn, True)
        await write(stream, data)
        return conn.frames, stream.send_window

    assert trio.run(frames, Y.YamuxStream.write) == trio.run(frames, F.LIBRARY["YamuxStream.write"])


def test_concurrent_streams_on_one_relayed_connection_keep_their_bytes_apart():
    sizes = [1, 17, 300, 4096, 65_000, 200_000, 9]

    async def main():
        async with triangle() as t:
            t.home.set_stream_handler(ECHO_PROTOCOL, echo)

            async def one(seed):
                channel = RelayedFrameChannel(await t.dialer.new_stream(t.home.get_id(), [ECHO_PROTOCOL]))
                for i, size in enumerate(sizes):
                    body = bytes([seed]) * 3 + os.urandom(size)
                    await channel.send(body)
                    assert await channel.receive() == body, (seed, i)
                await channel.close()
                assert await channel.receive() is None

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for seed in range(6):
                        nursery.start_soon(one, seed)

    trio.run(main)
