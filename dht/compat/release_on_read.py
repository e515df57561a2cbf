"""py-libp2p's own yamux knob PY_YAMUX_RELEASE_ON_READ set to "0" (the adjustment ``yamux_release_on_read``).

Upstream: the per-read WINDOW_UPDATEs and the ``PY_YAMUX_*`` knobs came with
https://github.com/libp2p/py-libp2p/pull/1337 (tuned for large transfers); no
upstream issue about their cost for small frames found. Patches nothing: sets
the environment variable ``YamuxStream._auto_tune_and_send_window_update``
(libp2p/stream_muxer/yamux/yamux.py) reads at call time.

Why: with the knob on (the library's default) a reader credits its sender
for every read whose bytes the half-window rule deferred -- one
WINDOW_UPDATE per small frame read; "0" stops that branch, so together with
``yamux_window_batching`` (dht/compat/yamux_window.py) updates go out once
per half window consumed.

A value the user set is theirs: any value but "0" keeps the adjustment off
(and says so); "0" already in the environment (a meshd parent's, or the
user's) counts as on. State: whether this process turned it on, and how.
"""
from __future__ import annotations

import os

from dht.compat.gate import gate, installed_version

NAME = "yamux_release_on_read"
# py-libp2p's own yamux knob (read at call time): "0" stops crediting partial reads at once.
ENV = "PY_YAMUX_RELEASE_ON_READ"
APPLIED = False
DETAIL = ""     # how it went on (the status row's reason says it)


def check(version: str) -> str | None:
    """None when the knob may be set for ``version``; else why not."""
    refused = gate(version)
    if refused is not None:
        return refused
    user = os.environ.get(ENV)
    if user is not None and user != "0" and not APPLIED:
        return f"off: {ENV}={user} set by the user, kept"
    return None


def apply(version: str | None = None) -> bool:
    """Set the knob to "0" unless the user chose otherwise (idempotent). True when it is "0"."""
    global APPLIED, DETAIL
    if APPLIED:
        return True
    version = installed_version() if version is None else version
    if check(version) is not None:
        return False
    if os.environ.get(ENV) == "0":      # inherited from a meshd parent, or the user's own choice: the same
        DETAIL = f" ({ENV}=0, already in the environment)"
    else:
        os.environ[ENV] = "0"
        DETAIL = f" ({ENV}=0)"
    APPLIED = True
    return True
