"""Yamux receive-window updates batched at half the window, go-yamux's rule (the adjustment ``yamux_window_batching``).

Upstream: the per-read updates came with
https://github.com/libp2p/py-libp2p/pull/1337 (tuned for large transfers); no
upstream issue about their cost for small frames found. Replaces
``YamuxStream._auto_tune_and_send_window_update``
(libp2p/stream_muxer/yamux/yamux.py).

Why: py-libp2p 0.8.1's ``YamuxStream._auto_tune_and_send_window_update`` runs
after every read and, whenever the consumed-but-uncredited bytes are above
zero and below the batching threshold, sends a WINDOW_UPDATE at once (its
"partial slack" branch; ``PY_YAMUX_RELEASE_ON_READ=0`` does not reach it). On
a relayed hop every frame is read at three yamux layers (the receiving end's
session stream, its circuit stream, and the relay's hop stream), so each
frame drew ~5 extra Noise messages, TCP sends and process wakeups per
direction (docs/measurements/2026-11-29.md).

What this does: ``apply()`` replaces that one method with go-yamux's
``sendWindowUpdate``: credit the sender back only when the bytes consumed
and not yet credited reach ``target_recv_window // 2`` (the library's own
threshold, ``_grow_threshold``), keeping its auto-tune doubling. The receive
window stays bounded by ``target_recv_window`` (the library's version could
credit twice the bytes read); a reader that consumes keeps its sender going
(at most half a window waits for credit); a reader that stops stops its
sender (backpressure intact).

State: the library's method, to restore (tests). Applied per process by
``dht.compat.registry.apply_libp2p_adjustments`` (called by the host
builder, never at import), only when ``dht.compat.gate`` lets it (the tested
release, and the method and the internals it uses --
``_grow_threshold``, ``_apply_autotune_epoch``, ``send_window_update`` --
still there). A peer with or without the patch interoperates:
WINDOW_UPDATE semantics are unchanged.
"""
from __future__ import annotations

from dht.compat.gate import gate, installed_version

__all__ = ["NAME", "apply", "check", "restore", "APPLIED"]

NAME = "yamux_window_batching"
APPLIED = False
_ORIGINAL = None


async def _batched_window_update(self, *, bytes_read: int = 0) -> None:
    """go-yamux sendWindowUpdate: one WINDOW_UPDATE per half window consumed."""
    total_delta = 0
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        # Bytes the reader consumed that the sender has not been credited for yet.
        delta = self.target_recv_window - (self.recv_window + buffered)
        if delta > 0 and delta >= self._grow_threshold():
            self.recv_window += delta
            total_delta = delta + self._apply_autotune_epoch(buffered)
            self._pending_recv_release = 0
    if total_delta > 0:
        await self.send_window_update(total_delta, skip_lock=True)


_NEEDED = ("_auto_tune_and_send_window_update", "_grow_threshold", "_apply_autotune_epoch", "send_window_update")


def check(version: str) -> str | None:
    """None when the patch fits ``version`` and the installed library; else why it stays off."""
    return gate(version, module="libp2p.stream_muxer.yamux.yamux", what="yamux", owner="YamuxStream", needs=_NEEDED)


def apply(version: str | None = None) -> bool:
    """Install the batched window update (idempotent). True when it is in place.

    ``version``: the library version to decide for (default: the installed one)."""
    global APPLIED, _ORIGINAL
    if APPLIED:
        return True
    if version is None:
        version = installed_version()
    if check(version) is not None:
        return False
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    _ORIGINAL = YamuxStream._auto_tune_and_send_window_update
    YamuxStream._auto_tune_and_send_window_update = _batched_window_update
    APPLIED = True
    return True


def restore() -> None:
    """Put the library's method back (tests compare both)."""
    global APPLIED
    if APPLIED and _ORIGINAL is not None:
        from libp2p.stream_muxer.yamux.yamux import YamuxStream
        YamuxStream._auto_tune_and_send_window_update = _ORIGINAL
        APPLIED = False
