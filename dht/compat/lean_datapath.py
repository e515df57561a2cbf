"""A leaner data path through py-libp2p 0.8.1's TCP, Noise and yamux layers (same bytes on the wire).

Status name ``libp2p_fastpath``, off switch ``MESHD_LIBP2P_FASTPATH=0`` (the
names users and tests know; not proto/fastpath.py's decode frames, not the
worker's framed port).

Upstream: no upstream issue found. Replaces, in the library:
``TrioTCPStream.read`` and the locks of ``TrioTCPStream``, ``NetStream``,
``Yamux`` and ``YamuxStream`` (libp2p/io/trio.py,
libp2p/network/stream/net_stream.py, libp2p/stream_muxer/yamux/yamux.py);
``Yamux._write_frame``, ``Yamux.read_stream``, ``Yamux._read_data_body``,
``YamuxStream.write``; ``read_exactly`` as imported by yamux and msgio
(libp2p/io/utils.py); ``BaseNoiseMsgReadWriter.read_msg``
(libp2p/security/noise/io.py).

Why: a relayed hop crosses the TCP/Noise/yamux stack six times per direction
(entry: its session stream and its circuit stream; relay: in and out; home:
circuit and session), and in py-libp2p 0.8.1 each crossing is mostly Python
overhead, not work: every uncontended ``trio.Lock`` acquire yields to the
scheduler (6-8 locks per frame per layer), a Noise message costs two
``recv`` calls, yamux and Noise build debug f-strings per frame with logging
off, and a DATA frame opens a timeout scope even when its body is already
decrypted (profiles and figures: docs/measurements/2026-11-29.md).

What ``apply()`` changes (each a replacement of one library method or lock
object, written against 0.8.1's code, keeping its semantics):

1. ``QuickLock`` replaces those trio locks: an uncontended acquire takes the
   lock without yielding; a contended one parks exactly like ``trio.Lock``
   (FIFO, cancellable). Every loop that moves bytes still reaches a real
   checkpoint in trio's socket send/receive.
2. ``TrioTCPStream.read`` receives up to ``TCP_READ_AHEAD_BYTES`` and serves
   later reads from that (one bounded buffer per connection, in order, under
   its read lock).
3. ``Yamux._write_frame`` / ``YamuxStream.write``: a write that fits one frame
   and the send window is framed directly (same header, same window
   accounting); anything else goes to the library's own method.
4. ``read_exactly`` (as imported by yamux and msgio): one read that returns
   everything is returned as is; otherwise the library's function finishes
   the job (with the bytes already read replayed first), so its errors are
   unchanged.
5. ``Yamux.read_stream`` serves an open stream with buffered bytes directly;
   every other case (waiting, EOF, reset, closing) is the library's code.
6. ``Yamux._read_data_body`` takes a body already in the Noise session's
   plaintext buffer without a timeout scope; else the library's (timed) read.
7. Noise ``read_msg`` without its per-message debug f-strings.

Together they more than halve the CPU of a relayed round trip.

Cancellation: ``QuickLock`` raises a pending cancel before taking the lock,
as ``trio.Lock`` does. Without that, a writer whose scope was cancelled got
as far as Noise-encrypting its message (spending a nonce) and was stopped at
the socket; the peer then failed to decrypt the next message and closed the
connection (found by the DCUtR test; tests/test_compat_lean_datapath.py keeps it).

State: none of ours beyond the per-connection read-ahead. Applied per process
by ``dht.compat.registry.apply_libp2p_adjustments`` (called by
``dht.host.build.build_host``, never at import), only when ``dht.compat.gate``
lets it and the library has every method it replaces (otherwise nothing is
touched, ``APPLIED`` stays False and ``check`` or the registry says why). A
patched peer and an unpatched one interoperate: nothing on the wire changes.
"""
from __future__ import annotations

import struct

import trio

from dht.compat.gate import gate, installed_version

__all__ = ["NAME", "apply", "check", "APPLIED", "QuickLock", "TCP_READ_AHEAD_BYTES"]

NAME = "libp2p_fastpath"     # the status name users and tests know (see above)
# MESHD_LIBP2P_FASTPATH=0 leaves the library exactly as it is (for comparison or a suspected bug).
DISABLE_ENV = "MESHD_LIBP2P_FASTPATH"
# One recv per wakeup: a whole Noise message (<= 65535 + 2 bytes) in one go in
# the common case; the bound on what a connection holds read ahead.
TCP_READ_AHEAD_BYTES = 64 * 1024
APPLIED = False
# The library's own methods this module replaced, by "Class.method" (tests compare both).
LIBRARY: dict[str, object] = {}


class QuickLock:
    """A ``trio.Lock`` whose uncontended acquire does not yield to the scheduler.

    Uncontended: a pending cancel is raised first (as ``trio.Lock`` does), then the
    lock is taken without a scheduler pass. Contended: ``trio.Lock.acquire`` (parks
    FIFO, cancellable, BrokenResourceError if the owner exits holding it). Only ``async with``, ``acquire``,
    ``acquire_nowait``, ``release``, ``locked`` and ``statistics`` exist, which
    is all py-libp2p uses of the locks it replaces."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def acquire(self) -> None:
        # Cancellation is delivered here exactly as trio.Lock delivers it (before the lock is
        # taken, not after): a writer must not get as far as Noise-encrypting a message (which
        # spends a nonce) that a pending cancel then stops at the socket -- the peer would fail
        # to decrypt everything after it and close the connection.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    def acquire_nowait(self) -> None:
        self._lock.acquire_nowait()

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def statistics(self):
        return self._lock.statistics()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self._lock.release()


def _swap_locks(cls, names: tuple[str, ...]) -> None:
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for name in names:
            setattr(self, name, QuickLock())

    __init__.__wrapped__ = original
    cls.__init__ = __init__


class _Replay:
    """A reader that first returns ``first`` (bytes already read), then reads on."""

    def __init__(self, first: bytes, reader) -> None:
        self._first = first
        self._reader = reader

    async def read(self, n=None) -> bytes:
        if self._first:
            if n is None or n >= len(self._first):
                out, self._first = self._first, b""
            else:
                out, self._first = self._first[:n], self._first[n:]
            return out
        return await self._reader.read(n)

    def __getattr__(self, name):        # conn_state() etc. for the library's error message
        return getattr(self._reader, name)


def _install(libp2p_version: str) -> bool:
    from libp2p.io import msgio, utils
    from libp2p.io.exceptions import ConnectionClosedError
    from libp2p.io.trio import TrioTCPStream
    from libp2p.network.stream.net_stream import NetStream
    from libp2p.security.noise import io as noise_io
    from libp2p.security.secure_session import SecureSession
    from libp2p.stream_muxer.yamux import yamux as Y

    if gate(libp2p_version) is not None:
        return False
    needed = [(TrioTCPStream, "read"), (Y.Yamux, "_write_frame"), (Y.Yamux, "read_stream"),
              (Y.Yamux, "_read_data_body"), (Y.YamuxStream, "write"), (SecureSession, "_drain"),
              (noise_io.BaseNoiseMsgReadWriter, "read_msg")]
    if not all(hasattr(cls, name) for cls, name in needed) or not hasattr(utils, "read_exactly"):
        return False
    if getattr(Y, "read_exactly", None) is not utils.read_exactly or msgio.read_exactly is not utils.read_exactly:
        return False

    LIBRARY.update({"TrioTCPStream.read": TrioTCPStream.__dict__["read"],
                    "Yamux._write_frame": Y.Yamux._write_frame, "YamuxStream.write": Y.YamuxStream.write,
                    "read_exactly": utils.read_exactly, "Yamux.read_stream": Y.Yamux.read_stream,
                    "Yamux._read_data_body": Y.Yamux._read_data_body,
                    "BaseNoiseMsgReadWriter.read_msg": noise_io.BaseNoiseMsgReadWriter.read_msg})

    # 1. locks
    _swap_locks(TrioTCPStream, ("read_lock", "write_lock"))
    _swap_locks(NetStream, ("_state_lock",))
    _swap_locks(Y.Yamux, ("streams_lock", "_write_lock"))
    _swap_locks(Y.YamuxStream, ("window_lock",))

    # 2. TCP read-ahead
    async def tcp_read(self, n: int | None = None) -> bytes:
        if n == 0:
            return b""
        async with self.read_lock:
            data = self.__dict__.get("_meshd_ahead", b"")
            if not data:
                try:
                    data = await self.stream.receive_some(TCP_READ_AHEAD_BYTES)
                except trio.BrokenResourceError as error:
                    raise ConnectionClosedError(f"TCP connection reset by remote peer: {error}",
                                                transport="tcp") from error
                except trio.ClosedResourceError:
                    return b""      # the library's answer: locally closed reads as EOF
            if n is None or len(data) <= n:
                self._meshd_ahead = b""
                return data
            self._meshd_ahead = data[n:]
            return data[:n]

    TrioTCPStream.read = tcp_read

    # 3. writes
    async def write_frame(self, data: bytes) -> None:
        async with self._write_lock:
            await self.secured_conn.write(data)

    header = struct.Struct(Y.YAMUX_HEADER_FORMAT)
    one_frame = Y.MAX_MESSAGE_SIZE - Y.HEADER_SIZE
    library_write = Y.YamuxStream.write

    async def stream_write(self, data: bytes) -> None:
        n = len(data)
        if (0 < n <= one_frame and n <= self.send_window and not self.send_closed and not self.closed
                and not self.window_lock.locked() and self.rw_lock._writer_lock.value == 1):
            self.send_window -= n
            await self.conn._write_frame(header.pack(0, Y.TYPE_DATA, 0, self.stream_id, n) + data)
            return
        await library_write(self, data)

    Y.Yamux._write_frame = write_frame
    Y.YamuxStream.write = stream_write

    # 4. read_exactly
    library_read_exactly = utils.read_exactly

    async def read_exactly(reader, n: int, retry_count: int = utils.DEFAULT_RETRY_READ_COUNT) -> bytes:
        data = await reader.read(n)
        if len(data) == n:
            return data if type(data) is bytes else bytes(data)
        return await library_read_exactly(_Replay(bytes(data), reader), n, retry_count)

    Y.read_exactly = read_exactly
    msgio.read_exactly = read_exactly

    # 5. read_stream
    library_read_stream = Y.Yamux.read_stream

    async def read_stream(self, stream_id: int, n: int = -1) -> bytes:
        stream = self.streams.get(stream_id)
        buffer = self.stream_buffers.get(stream_id)
        if (stream is not None and buffer and not stream.recv_closed and not stream.reset_received
                and not stream.closed and not self.streams_lock.locked()
                and not self.event_shutting_down.is_set()):
            if n is None or n == -1 or n >= len(buffer):
                data = bytes(buffer)
                buffer.clear()
            else:
                data = bytes(buffer[:n])
                del buffer[:n]
            return data
        return await library_read_stream(self, stream_id, n)

    Y.Yamux.read_stream = read_stream

    # 6. DATA bodies already decrypted
    library_read_body = Y.Yamux._read_data_body

    async def read_data_body(self, length: int) -> bytes:
        conn = self.secured_conn
        if type(conn) is SecureSession and conn.high_watermark - conn.low_watermark >= length:
            return conn._drain(length)
        return await library_read_body(self, length)

    Y.Yamux._read_data_body = read_data_body

    # 7. Noise read_msg without its debug f-strings
    async def noise_read_msg(self, prefix_encoded: bool = False) -> bytes:
        encrypted = await self.read_writer.read_msg()
        return self.decrypt(encrypted[len(self.prefix):] if prefix_encoded else encrypted)

    noise_io.BaseNoiseMsgReadWriter.read_msg = noise_read_msg
    return True


def check(version: str) -> str | None:
    """None when the lean data path may go in for ``version``; else why it stays off (no library change)."""
    return gate(version, module="libp2p.stream_muxer.yamux.yamux", what="yamux", disable_env=DISABLE_ENV)


def apply(version: str | None = None) -> bool:
    """Install the lean data path (idempotent). True when it is in place.

    ``version``: the library version to decide for (default: the installed one)."""
    global APPLIED
    if APPLIED:
        return True
    if version is None:
        version = installed_version()
    if check(version) is not None:
        return False
    APPLIED = _install(version)
    return APPLIED
