"""``meshd status``: ask the local daemon for its state and the coverage map."""
from __future__ import annotations

import argparse
import json

from meshd.cli.common import add_config_arguments, fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the raw status object")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from meshd.cli.status_view import render_status
    from meshd.config import load_config
    from meshd.daemon.control import request
    from proto.errors import MeshdError

    try:
        config = load_config(args.config, {"data_dir": args.data_dir})
        reply = request(config.control_socket, "status")
    except MeshdError as exc:
        return fail(str(exc))
    reply.pop("ok", None)
    if reply.get("mode") == "relay" and not args.json:   # relay-mode hook (meshd/daemon/relay_mode.py)
        from meshd.daemon.relay_mode import render_relay_status as render_status
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    else:
        print(render_status(reply), end="")
    return 0
