"""The one gate every py-libp2p adjustment in relay/ passes before it touches the library.

An adjustment (relay/adjustments.py lists them) goes in only when the
installed py-libp2p is exactly ``TESTED_LIBP2P_VERSION``, its off switch is
not set to "0", and the library still has what it replaces. ``gate`` answers
None when all of that holds, else the reason it stays off -- the text
``meshd status`` shows. Pure: reads the environment and imports, changes nothing.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Iterable

# The one py-libp2p release every adjustment was written and measured against.
TESTED_LIBP2P_VERSION = "0.8.1"


def installed_version() -> str:
    """The installed py-libp2p version, "" when it is not installed."""
    try:
        return importlib.metadata.version("libp2p")
    except importlib.metadata.PackageNotFoundError:
        return ""


def gate(version: str, *, module: str, what: str, owner: str | None = None, needs: Iterable[str] = (),
         disable_env: str | None = None) -> str | None:
    """None when the adjustment may go in for ``version``; else why it stays off.

    ``module``: the library module it changes (``what`` names it in the reason);
    ``owner`` and ``needs``: the class in that module and the attributes it replaces.
    """
    if disable_env is not None and os.environ.get(disable_env, "1") == "0":
        return f"off: {disable_env}=0"
    if version != TESTED_LIBP2P_VERSION:
        return f"off: libp2p {version or '(none)'} is installed, written for {TESTED_LIBP2P_VERSION} only"
    try:
        found = importlib.import_module(module)
    except ImportError as exc:  # libp2p missing or restructured: leave it alone
        return f"off: cannot import libp2p's {what} ({exc})"
    if owner is not None:
        found = getattr(found, owner, None)
        if found is None:
            return f"off: libp2p's {what} has no {owner}"
    missing = [name for name in needs if getattr(found, name, None) is None]
    if missing:
        return f"off: the library's {owner or what} has no {', '.join(missing)}"
    return None
