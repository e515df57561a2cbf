"""An expert peer's side of one connection: expert exchange requests answered from an ExpertStore.

The listener (TLS with the node's certificate, whose hash is the pin in the
node's signed expert record; one bounded thread per connection) is the edge
shard/edges/expert_server.py; each connection runs ``serve_connection``:

    TLS handshake (the edge) -> ServerLink (proto/moe/link.py):
      hello   -> WELCOME, or REFUSE (naming our versions and acts) and close
      request -> every item served here? compute each expert on its rows
                 (under one compute lock: CPU experts gain nothing from running
                 concurrently) -> REPLY; otherwise FAILURE naming the expert
      bad bytes, EOF, a timeout -> close the connection

``serve_connection(sock, ...)`` is that loop for one already connected
socket (tests drive it over a socket pair). Counters (connections, requests,
rows, bytes) are kept for the worker's health report (``ServerStats``).
"""
from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from proto import moe as W
from proto.errors import ProtocolError
from proto.moe.link import PREFIX_BYTES, ServerLink
from shard.experts.transport import recv_exactly

__all__ = ["ExpertCompute", "serve_connection", "ServerStats", "IDLE_TIMEOUT_S"]

# A holder idles between generations; an idle connection is closed after this.
IDLE_TIMEOUT_S = 600.0


class ExpertCompute(Protocol):
    hidden_size: int

    def serves(self, layer: int, expert: int) -> bool: ...

    def compute(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray: ...


@dataclass
class ServerStats:
    connections: int = 0
    refused: int = 0
    requests: int = 0
    rows: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict:
        with self.lock:
            return {k: getattr(self, k) for k in ("connections", "refused", "requests", "rows",
                                                  "bytes_received", "bytes_sent")}


def _answer(store: ExpertCompute, link: ServerLink, req: W.Request, compute_lock: threading.Lock) -> bytes:
    if req.hidden != store.hidden_size:
        return link.failure(req, W.FAILURE_BAD_REQUEST, f"hidden size {req.hidden}; this model's is "
                                                         f"{store.hidden_size}")
    missing = [i.expert for i in req.items if not store.serves(req.layer, i.expert)]
    if missing:
        return link.failure(req, W.FAILURE_NOT_SERVED, f"layer {req.layer}: experts {missing[:8]} are not "
                                                        "served here")
    with compute_lock:
        outputs = [store.compute(req.layer, item.expert, req.item_rows(item)) for item in req.items]
    return link.reply(req, outputs)


def serve_connection(sock, store: ExpertCompute, *, artifact: str, recipe: str,
                     compute_lock: threading.Lock | None = None, stats: ServerStats | None = None,
                     versions: tuple[int, ...] = W.SUPPORTED_VERSIONS, acts: tuple[int, ...] = W.ACTS,
                     idle_timeout_s: float = IDLE_TIMEOUT_S) -> str:
    """Serve one connection until it closes; returns why it ended."""
    link = ServerLink(artifact=artifact, recipe=recipe, versions=versions, acts=acts)
    lock = compute_lock or threading.Lock()
    stats = stats or ServerStats()
    try:
        sock.settimeout(idle_timeout_s)
        while True:
            try:
                length = link.frame_length(recv_exactly(sock, PREFIX_BYTES))
                out, req = link.receive(recv_exactly(sock, length))
            except ProtocolError as exc:
                return f"protocol error: {exc}"
            if out:
                sock.sendall(out)
            if link.closed:
                with stats.lock:
                    stats.refused += 1
                return f"refused: {link.close_reason}"
            if req is not None:
                reply = _answer(store, link, req, lock)
                sock.sendall(reply)
                with stats.lock:
                    stats.requests += 1
                    stats.rows += sum(len(i.index) for i in req.items)
    except (OSError, ssl.SSLError) as exc:
        return f"transport: {exc}"
    finally:
        with stats.lock:
            stats.bytes_received += link.bytes_received
            stats.bytes_sent += link.bytes_sent
