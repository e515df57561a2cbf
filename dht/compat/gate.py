"""The one gate every py-libp2p adjustment passes before it touches the library.

Each adjustment (dht/compat/__init__.py lists them) reaches into the
library's internals as they are in one release, ``TESTED_LIBP2P_VERSION``,
where it was written and measured; on any other release the library's own
behaviour is the safer bet. ``gate`` answers None when an adjustment may go
in -- the installed py-libp2p is exactly that release, the adjustment's off
switch is not "0", and the library still has what it replaces -- else the
reason it stays off, the text ``meshd status`` shows. Pure: reads the
environment and imports, changes nothing.

This is the only place that names the release; pyproject.toml pins the same
one (a test keeps the two equal).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Iterable

__all__ = ["TESTED_LIBP2P_VERSION", "installed_version", "gate"]

# The one py-libp2p release every adjustment was written and measured against.
TESTED_LIBP2P_VERSION = "0.8.1"


def installed_version() -> str:
    """The installed py-libp2p version, "" when it is not installed."""
    try:
        return importlib.metadata.version("libp2p")
    except importlib.metadata.PackageNotFoundError:
        return ""


def gate(version: str, *, module: str | None = None, what: str = "", owner: str | None = None,
         needs: Iterable[str] = (), disable_env: str | None = None) -> str | None:
    """None when the adjustment may go in for ``version``; else why it stays off.

    ``disable_env``: the adjustment's off switch ("0" turns it off); ``module``: the
    library module it changes (``what`` names it in the reason); ``owner`` and
    ``needs``: the class in that module and the attributes it replaces. With no
    ``module`` only the version and the switch are checked (adjustments of a
    library object whose shape the caller checks itself).
    """
    if not version:
        return "off: py-libp2p is not installed"
    if version != TESTED_LIBP2P_VERSION:
        return f"off: libp2p {version} is installed, written for {TESTED_LIBP2P_VERSION} only"
    if disable_env is not None and os.environ.get(disable_env, "1") == "0":
        return f"off: {disable_env}=0"
    if module is None:
        return None
    try:
        found: object = importlib.import_module(module)
    except ImportError as exc:  # libp2p restructured: leave it alone
        return f"off: cannot import libp2p's {what} ({exc})"
    if owner is not None:
        found = getattr(found, owner, None)
        if found is None:
            return f"off: libp2p's {what} has no {owner}"
    missing = [name for name in needs if getattr(found, name, None) is None]
    if missing:
        return f"off: the library's {owner or what} has no {', '.join(missing)}"
    return None
