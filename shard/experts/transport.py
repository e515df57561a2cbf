"""The thin blocking transport of the expert exchange: one socket, one ``ClientLink``.

``ExpertConnection.exchange`` is THE one exchange function of a shard holder:
send the framed request, read the 4-byte prefix, read exactly that body,
hand it to the link core (proto/moe/link.py) -- which checks it answers
this request. Any failure on the way (connect, TLS, short read, EOF, timeout,
a bad frame, a reply that is not ours) marks the link FAILED; a failed link
raises ``LinkFailed`` at once on every later exchange, without sending or
reading a byte. Reads never go past the current frame, so whatever a peer
sends after a failed exchange stays unread on the socket until it closes.

Why length-prefixed frames over a socket rather than a gRPC stream: the
exchange sits inside a layer's forward, once per sparse layer per step per
peer, and a bare gRPC stream round trip costs some twenty times a raw
socket's (``meshd bench pipeline``'s floors): at dozens of sparse layers, tens
of milliseconds per token for gRPC alone (docs/measurements/2026-12-01.md).
The frames are the project's (proto/frames.py).

Authentication: direct connections speak TLS and the peer's certificate must
hash (SHA-256 of its DER) to the pin in its signed expert record (the same
pin as its shard capability, meshd/reach/tls.py). The handshake proves the
peer holds that certificate's key, so no CA is involved. Relayed expert
peers (libp2p Noise circuits) are not supported: an expert peer must be
directly dialable. ``pin=None`` (plaintext) exists for tests over socket
pairs only.
"""
from __future__ import annotations

import hashlib
import socket
import ssl

import numpy as np

from proto import moe as W
from proto.errors import MeshdError, ProtocolError
from proto.moe.link import PREFIX_BYTES, ClientLink, LinkFailed, PeerRefused

__all__ = ["ExpertConnection", "recv_exactly", "client_tls_context", "server_tls_context",
           "CONNECT_TIMEOUT_S", "EXCHANGE_TIMEOUT_S", "PEER_TLS_NAME"]

# A live expert peer on a LAN accepts within milliseconds; a dead one must not
# hold a layer step for long.
CONNECT_TIMEOUT_S = 3.0
# One exchange: a 128-row prefill chunk through 8 experts of a big model on a
# slow CPU takes well under a few seconds; a silent peer is failed after this.
EXCHANGE_TIMEOUT_S = 30.0
# The name meshd certificates carry (meshd/reach/tls.py); peers are identified by the pin.
PEER_TLS_NAME = "meshd-peer"


def recv_exactly(sock, n: int) -> bytes:
    """Exactly n bytes (ConnectionError on EOF before them); never reads past them."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def client_tls_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE   # trust comes from the pin checked right after the handshake
    return ctx


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


class ExpertConnection:
    def __init__(self, sock, link: ClientLink, *, exchange_timeout_s: float = EXCHANGE_TIMEOUT_S) -> None:
        self.sock = sock
        self.link = link
        self.exchange_timeout_s = exchange_timeout_s

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, peer: str, host: str, port: int, pin: bytes | None, *, version: int, act: int,
             artifact: str, recipe: str, connect_timeout_s: float = CONNECT_TIMEOUT_S,
             exchange_timeout_s: float = EXCHANGE_TIMEOUT_S) -> ExpertConnection:
        """Connect, authenticate (TLS pinned to ``pin``), say hello; PeerRefused / LinkFailed on failure."""
        link = ClientLink(peer, version=version, act=act, artifact=artifact, recipe=recipe)
        try:
            raw = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as exc:
            raise link.fail(f"cannot connect to {host}:{port}: {exc}") from exc
        sock = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if pin is not None:
                sock = client_tls_context().wrap_socket(raw, server_hostname=PEER_TLS_NAME)
                der = sock.getpeercert(binary_form=True) or b""
                if hashlib.sha256(der).digest() != pin:
                    raise link.fail(f"{host}:{port} presented a certificate that does not match the pin in "
                                    "its signed expert record")
            conn = cls(sock, link, exchange_timeout_s=exchange_timeout_s)
            conn.hello(connect_timeout_s)
            return conn
        except LinkFailed:
            sock.close()
            raise
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise link.fail(f"TLS with {host}:{port} failed: {exc}") from exc

    @classmethod
    def over(cls, sock, peer: str, *, version: int, act: int, artifact: str, recipe: str,
             timeout_s: float = EXCHANGE_TIMEOUT_S) -> ExpertConnection:
        """An already connected socket (tests: a socket pair); says hello."""
        conn = cls(sock, ClientLink(peer, version=version, act=act, artifact=artifact, recipe=recipe),
                   exchange_timeout_s=timeout_s)
        conn.hello(timeout_s)
        return conn

    def hello(self, timeout_s: float) -> None:
        link = self.link
        try:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(link.hello())
            body = self._read_frame()
        except LinkFailed:
            raise
        except ConnectionError as exc:
            link.fail(str(exc))
            raise PeerRefused(link.peer, f"closed the connection on our v{link.version} {W.act_name(link.act)} "
                                         "hello: it runs a meshd that speaks neither; upgrade it, or speak "
                                         "an older version to it") from exc
        except (OSError, ssl.SSLError) as exc:
            raise link.fail(f"hello failed: {exc}") from exc
        link.receive(body)   # Welcome, or PeerRefused naming what the peer speaks

    # ------------------------------------------------------------------ the exchange
    def _read_frame(self) -> bytes:
        length = self.link.frame_length(recv_exactly(self.sock, PREFIX_BYTES))
        return recv_exactly(self.sock, length)

    def exchange(self, layer: int, rows: np.ndarray, items: list[W.Item]) -> W.Reply:
        """Send one request and read its reply; LinkFailed (at once, if already failed) otherwise."""
        link = self.link
        if link.failed:
            raise LinkFailed(link.peer, f"already failed ({link.failure}); reconnect")
        try:
            data = link.request(layer, rows, items)
            self.sock.settimeout(self.exchange_timeout_s)
            self.sock.sendall(data)
            return link.receive(self._read_frame())
        except LinkFailed:
            raise
        except (OSError, ssl.SSLError, ProtocolError) as exc:
            raise link.fail(f"{type(exc).__name__}: {exc}") from exc
        except MeshdError as exc:   # e.g. LocalError from a request we could not encode: not the peer's fault
            raise link.fail(f"could not send: {exc}") from exc

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
