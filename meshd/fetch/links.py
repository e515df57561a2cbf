"""Links to providers: a peer's fetch port over pinned TLS, or this node's own holdings.

Both answer the same two questions -- the manifest of a root, and the bytes
of a run of chunks -- so the fetcher treats a local slice and a remote peer
alike (a LOAD of a new range copies what this node already holds instead of
fetching it again).

``TlsLink`` keeps one connection: ``send(run)`` writes a request (up to
``wire.PIPELINE_DEPTH`` unanswered), ``receive(run)`` yields the run's chunks
one by one as they arrive, each a view into one reused buffer (valid until
the next chunk). Every read and write has a timeout (``IO_TIMEOUT_S``); a
reply head with another length than the chunks asked for is refused before
its body is read. Errors: ``LinkError`` (transport: the scheduler backs off),
``NotHeld`` (the peer lacks those chunks), a ProtocolError (the peer broke
the protocol: it is dropped), ``CertificateMismatch`` (not the pinned peer).
"""
from __future__ import annotations

import hashlib
import socket
import ssl
from collections.abc import Iterator
from typing import Protocol

from meshd.errors import CertificateMismatch
from meshd.fetch import wire
from meshd.fetch.holdings import Holdings
from meshd.fetch.scheduler import Run
from meshd.reach.tls import PEER_TLS_NAME, split_endpoint
from proto.errors import MeshdError
from shard.model.manifest import Manifest

__all__ = ["Link", "LinkError", "NotHeld", "TlsLink", "LocalLink", "CONNECT_TIMEOUT_S", "IO_TIMEOUT_S"]

# A LAN peer connects in milliseconds, an internet one in a few round trips.
CONNECT_TIMEOUT_S = 10.0
# No byte for this long: the provider is gone or stalled; its run goes to another.
IO_TIMEOUT_S = 30.0
# Socket buffer: a 1 MiB chunk in a few reads.
RECV_BYTES = 1 << 20


class LinkError(MeshdError):
    """The link to a provider failed (connect, TLS, reset, timeout): nobody's fault proven."""


class NotHeld(MeshdError):
    """The provider answered that it lacks the asked chunks (or the model)."""


class Link(Protocol):
    """What a fetch asks of a provider's link (TlsLink, LocalLink)."""

    def connect(self) -> None: ...
    def close(self) -> None: ...
    def manifest(self) -> bytes: ...
    def send(self, run: Run) -> None: ...
    def receive(self, run: Run, manifest: Manifest) -> Iterator[tuple[int, memoryview]]: ...


def client_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE   # the pin below is the check: self-signed certificates by design
    return ctx


class TlsLink:
    def __init__(self, peer: str, endpoint: str, pin: bytes, root: bytes, *,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, io_timeout_s: float = IO_TIMEOUT_S) -> None:
        self.peer, self.endpoint, self.pin, self.root = peer, endpoint, pin, root
        self.connect_timeout_s, self.io_timeout_s = connect_timeout_s, io_timeout_s
        self.sock: ssl.SSLSocket | None = None
        self.received = 0                 # bytes of replies read (heads and bodies)
        self._buf = bytearray(RECV_BYTES)

    def connect(self) -> None:
        if self.sock is not None:
            return
        host, port = split_endpoint(self.endpoint)
        try:
            raw = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        except OSError as exc:
            raise LinkError(f"cannot reach {self.peer[:16]}'s fetch port {self.endpoint}: {exc}") from exc
        try:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock = client_context().wrap_socket(raw, server_hostname=PEER_TLS_NAME)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise LinkError(f"TLS with {self.endpoint} failed: {exc}") from exc
        if hashlib.sha256(sock.getpeercert(binary_form=True) or b"").digest() != self.pin:
            sock.close()
            raise CertificateMismatch(f"{self.endpoint} presented a certificate that does not match the pin in "
                                      f"{self.peer[:16]}'s signed record; refusing to fetch from it")
        sock.settimeout(self.io_timeout_s)
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def _connected(self) -> ssl.SSLSocket:
        if self.sock is None:
            raise LinkError(f"the link to {self.endpoint} is closed")
        return self.sock

    def _send(self, req: wire.Request) -> None:
        self.connect()
        try:
            self._connected().sendall(wire.encode_request(req))
        except OSError as exc:
            self.close()
            raise LinkError(f"sending to {self.endpoint} failed: {exc}") from exc

    def _exact(self, n: int, into: memoryview | None = None) -> memoryview:
        view = into if into is not None else memoryview(bytearray(n))
        got = 0
        sock = self._connected()
        try:
            while got < n:
                k = sock.recv_into(view[got:n])
                if not k:
                    raise LinkError(f"{self.endpoint} closed the connection")
                got += k
        except OSError as exc:   # timeouts are OSErrors too
            self.close()
            raise LinkError(f"reading from {self.endpoint} failed: {exc}") from exc
        self.received += n
        return view[:n]

    def _head(self, op: wire.Op, expect: int | None) -> wire.ReplyHead:
        head = wire.decode_reply_head(bytes(self._exact(wire.REPLY_HEAD_BYTES)), op=op, expect=expect)
        if head.status != wire.Status.OK:
            if head.status == wire.Status.BAD_REQUEST:
                self.close()
            raise NotHeld(f"{self.peer[:16]} answered {head.status.name}")
        return head

    def manifest(self) -> bytes:
        self._send(wire.Request(wire.Op.MANIFEST, self.root))
        head = self._head(wire.Op.MANIFEST, None)
        return bytes(self._exact(head.length))

    def send(self, run: Run) -> None:
        self._send(wire.Request(wire.Op.CHUNKS, self.root, run.entry, run.first, run.count))

    def receive(self, run: Run, manifest: Manifest) -> Iterator[tuple[int, memoryview]]:
        """(chunk index, bytes) of the run in order; the view is reused for the next chunk."""
        self._head(wire.Op.CHUNKS, run.nbytes)
        buf = memoryview(self._buf)
        for c in range(run.first, run.first + run.count):
            length = manifest.chunk_span(run.entry, c)[1]
            if length > len(buf):
                self._buf = bytearray(length)
                buf = memoryview(self._buf)
            yield c, self._exact(length, buf)


class LocalLink:
    """This node's own holdings as a provider (a copy from disk, no network)."""

    def __init__(self, holdings: Holdings, root: bytes) -> None:
        self.peer, self.holdings, self.root = "local", holdings, root
        self.received = 0
        self._pending: list[Run] = []

    def connect(self) -> None:
        pass

    def close(self) -> None:
        self._pending.clear()

    def manifest(self) -> bytes:
        m = self.holdings.manifest(self.root)
        if m is None:
            raise NotHeld("this node holds nothing of that model")
        return m.encode()

    def send(self, run: Run) -> None:
        self._pending.append(run)

    def receive(self, run: Run, manifest: Manifest) -> Iterator[tuple[int, memoryview]]:
        self._pending.remove(run)
        views = self.holdings.read(self.root, run.entry, run.first, run.count)
        if views is None:
            raise NotHeld("this node does not hold those chunks")
        for k, view in enumerate(views):
            yield run.first + k, view
