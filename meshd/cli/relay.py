"""``meshd relay``: run relay mode (circuit relay v2 hop + DHT server) in the foreground."""
from __future__ import annotations

import argparse
import sys
import time

from meshd.cli.common import add_config_arguments, fail, first_meshd_error, setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", action="append", help="libp2p multiaddr to listen on (repeatable)")
    parser.add_argument("--bootstrap", nargs="+", action="extend", help="multiaddrs of peers to join through")
    parser.add_argument("--swarm", help="the swarm whose DHT this relay serves (default: 'default')")
    parser.add_argument("--advertise-host",
                        help="public IP announced in our DHT relay record when listening on 0.0.0.0")
    parser.add_argument("--record-ttl", type=float, dest="record_ttl_s", help="lifetime of our relay record, seconds")
    parser.add_argument("--no-dht", action="store_true", help="relay only; do not serve the DHT")
    parser.add_argument("--ready-file", help="write {peer_id, addrs} as JSON here once serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the libp2p and relay details")
    add_config_arguments(parser)


def _progress(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    try:
        import functools
        import json
        import os

        import trio

        from meshd.config import load_config
        from meshd.daemon.relay_mode import run_relay

        config = load_config(args.config, {
            "data_dir": args.data_dir, "listen": tuple(args.listen) if args.listen else None,
            "bootstrap": tuple(args.bootstrap) if args.bootstrap else None, "swarm": args.swarm,
            "advertise_host": args.advertise_host, "record_ttl_s": args.record_ttl_s})

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                node = await nursery.start(functools.partial(run_relay, config, _progress, with_dht=not args.no_dht))
                if args.ready_file:
                    tmp = args.ready_file + ".tmp"
                    ready = {"peer_id": node.peer_id, "addrs": node.addrs(), "pid": os.getpid()}
                    await trio.Path(tmp).write_text(json.dumps(ready))
                    os.replace(tmp, args.ready_file)
                print("ready", flush=True)
                with trio.open_signal_receiver(2, 15) as signals:  # SIGINT, SIGTERM
                    async for _ in signals:
                        _progress("stopping the relay")
                        nursery.cancel_scope.cancel()
                        break

        trio.run(main)
    except BaseException as exc:  # noqa: BLE001 - errors arrive wrapped in nursery exception groups
        ours = first_meshd_error(exc)
        if ours is not None:
            return fail(str(ours))
        if isinstance(exc, KeyboardInterrupt):
            return 130
        raise
    return 0
