"""``meshd id``: print this node's peer id (creating the identity on first use)."""
from __future__ import annotations

import argparse

from meshd.cli.common import add_config_arguments, fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from dht.identity import load_or_create_identity
    from meshd.config import load_config
    from proto.errors import MeshdError

    try:
        config = load_config(args.config, {"data_dir": args.data_dir})
        print(load_or_create_identity(config.data_dir).peer_id)
    except MeshdError as exc:
        return fail(str(exc))
    return 0
