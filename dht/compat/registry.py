"""The registry of py-libp2p adjustments: what this process changed in the library, and why.

Data flow:
* ``apply_libp2p_adjustments()`` -- called by ``dht.host.build.build_host``
  before a host exists, so every process that builds one (daemon, relay mode,
  the benchmark harnesses, tests) runs its connections on the same adjusted
  library -- asks each host-wide patch module in ``HOST_PATCHES`` whether it
  fits (``check``, which passes ``dht.compat.gate``) and applies it; each
  decision is recorded under the module's ``NAME``.
* Code that adjusts a library object it owns records its own decision with
  ``decide``: ``DhtNode`` (dht/node.py: ``dht_inbound_handlers``,
  ``dht_maintenance``), the DCUtR service (meshd/reach/direct_upgrade.py:
  ``dcutr_policy``) and mDNS (dht/host/mdns.py: ``mdns_broadcaster``, its
  class from dht/compat/mdns_broadcaster.py). So compat never imports the
  code above it.
* ``snapshot()`` / ``library_status()`` are what ``meshd status`` shows;
  ``render_library`` turns them into its text lines.

Nothing here runs at import. State: the registry, name -> ``Adjustment``
(applied or not, and the reason), one per process, guarded by a lock.
Patches are process-wide and never undone by this module: once an
adjustment is on, a later decision keeps reporting it on.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

from dht.compat import (
    dial_head_start,
    inbound_limits,
    lean_datapath,
    no_auto_connect,
    peer_record_gc,
    release_on_read,
    yamux_window,
)
from dht.compat.gate import TESTED_LIBP2P_VERSION, installed_version

__all__ = ["Adjustment", "HOST_PATCHES", "record", "decide", "snapshot", "apply_libp2p_adjustments",
           "library_status", "render_library"]

# The host-wide patches, in the order they are applied (each module: NAME, check, apply).
HOST_PATCHES = (release_on_read, yamux_window, lean_datapath, inbound_limits, dial_head_start, no_auto_connect,
                peer_record_gc)


@dataclass(frozen=True, slots=True)
class Adjustment:
    name: str
    applied: bool
    reason: str            # why it is on, or why it is off
    library_version: str   # the libp2p version the decision was made for ("" if none is installed)


_lock = threading.Lock()
_apply_lock = threading.Lock()     # one apply at a time (two threads building hosts at once)
_registry: dict[str, Adjustment] = {}


def record(name: str, applied: bool, reason: str, version: str) -> Adjustment:
    """Remember the decision for ``name``; an adjustment already on stays on (patches are not undone)."""
    with _lock:
        old = _registry.get(name)
        if old is not None and old.applied and not applied:
            return old
        adj = Adjustment(name, applied, reason, version)
        _registry[name] = adj
        return adj


def _on(version: str) -> str:
    return f"on: libp2p {version}, the version it was written for"


def decide(name: str, off: str | None, version: str, detail: str = "") -> Adjustment:
    """Record an adjustment its owner made (``off`` None) or left out (``off``: why, from the gate)."""
    return record(name, True, _on(version) + detail, version) if off is None else record(name, False, off, version)


def snapshot() -> list[dict]:
    """The registry as JSON-able rows, by name (``meshd status``)."""
    with _lock:
        return [asdict(_registry[name]) for name in sorted(_registry)]


def apply_libp2p_adjustments(version: str | None = None) -> list[Adjustment]:
    """Apply the host-wide patches (idempotent); returns their registry entries.

    ``version`` is the library version to decide for (default: the installed one);
    tests pass another string to see the gate refuse."""
    version = installed_version() if version is None else version
    out = []
    with _apply_lock:
        for module in HOST_PATCHES:
            off = module.check(version)
            if off is None and not module.apply(version):
                off = "off: the library lacks what it replaces"
            out.append(decide(module.NAME, off, version, getattr(module, "DETAIL", "")))
    return out


def library_status() -> dict:
    """The ``libp2p`` section of ``meshd status``: installed version and every adjustment's decision."""
    return {"version": installed_version(), "tested_version": TESTED_LIBP2P_VERSION, "adjustments": snapshot()}


def render_library(status: dict | None) -> list[str]:
    """Text lines for a ``library_status()`` dict (pure; used by both status views)."""
    if not status:
        return []
    rows = status.get("adjustments") or []
    lines = [f"libp2p     {status.get('version') or '(not installed)'} "
             f"({sum(1 for r in rows if r['applied'])} of {len(rows)} adjustments on)"]
    width = max((len(r["name"]) for r in rows), default=0)
    for r in rows:
        lines.append(f"  {'on ' if r['applied'] else 'off'}  {r['name'].ljust(width)}  {r['reason']}")
    return lines
