"""Shared CLI plumbing: config flags, logging, and one-line errors."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from proto.errors import MeshdError


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (flags override it)")
    parser.add_argument("--data-dir", type=Path,
                        help="identity, TLS key, control socket (default ~/.local/share/meshd)")


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # py-libp2p logs every refused dial and reset stream at WARNING/ERROR; those
    # are expected events for a daemon, not news for its user. Importing libp2p
    # resets its logger (level WARNING, no propagation), so call this again
    # after the import.
    libp2p_logger = logging.getLogger("libp2p")
    libp2p_logger.setLevel(logging.INFO if verbose else logging.CRITICAL)
    libp2p_logger.propagate = verbose


def first_meshd_error(exc: BaseException) -> MeshdError | None:
    """Find our error inside (possibly nested) exception groups from nurseries."""
    if isinstance(exc, MeshdError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = first_meshd_error(sub)
            if found is not None:
                return found
    return None


def fail(message: str, code: int = 1) -> int:
    print(f"meshd: error: {message}", file=sys.stderr)
    return code
