"""A bare relayed home node for the relay benchmark and its tests (``python -m meshd.benchmarks.relay_home``).

``meshd join`` is the real home node: its daemon reserves on relays and
serves its own worker to peers through them (meshd/daemon/, meshd/reach/).
This harness keeps the relay path and nothing else, so ``meshd bench relay``
can put the same already-running worker behind a direct and a relayed hop
and measure only the transport: no DHT, no tracker, no worker of its own.

    host (Noise + yamux, listening where told; dht/host/)
    ├── dial-back service (answers other peers' probes)
    ├── STOP service (accepts circuits addressed to us)
    ├── RelayedSessionServer -> the given worker's Unix frame socket (relay/transport.py)
    ├── probe: dial-back through the relay -> PUBLIC / PRIVATE / UNKNOWN
    ├── keep_reserved on the relay (renewed), relayed addrs -> ready file
    └── with --bench-echo: ECHO_PROTOCOL, every frame sent back (the benchmark's libp2p floor)

Ready file (JSON, written atomically once the first reservation answered):
``{"peer_id", "direct_addrs", "relayed_addrs", "verdict", "pid"}``.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import time

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr

from dht.host.bootstrap import connect_bootstrap
from dht.host.build import running_host
from dht.identity import Identity, load_or_create_identity
from proto.errors import ProtocolError
from relay.client import stop_service
from relay.errors import RelayUnreachable
from relay.reachability import keep_reserved, probe, serve_dialback
from relay.transport import RelayedFrameChannel, RelayedSessionServer

# Only with --bench-echo (benchmarks): frames sent back as they came, bounded by the framing.
ECHO_PROTOCOL = TProtocol("/meshd/bench-echo/1")

log = logging.getLogger(__name__)


async def run_home_node(identity: Identity, listen: list[str], relay_addr: str, worker: str,
                        on_ready, *, bench_echo: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> None:
    relay = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
    async with running_host(identity, listen) as host:
        serve_dialback(host)
        server = RelayedSessionServer(worker)
        server.attach(host)
        if bench_echo:
            host.set_stream_handler(ECHO_PROTOCOL, echo)
        try:
            async with stop_service(host):
                await connect_bootstrap(host, [relay_addr], timeout_s=15.0)
                direct = [str(a) for a in host.get_addrs()]
                verdict = await probe(host, [relay.peer_id], [a.split("/p2p/")[0] for a in direct])
                async with trio.open_nursery() as nursery:
                    state: dict = {"peer_id": identity.peer_id, "direct_addrs": direct,
                                   "verdict": verdict.value, "pid": os.getpid()}

                    def on_addrs(addrs: tuple[str, ...]) -> None:
                        on_ready({**state, "relayed_addrs": list(addrs)})

                    await nursery.start(functools.partial(keep_reserved, host, lambda: [relay], on_addrs,
                                                          wall=time.time))
                    task_status.started(host)
        finally:
            server.close()


async def echo(stream) -> None:
    """Send every frame back (the benchmark's floor: libp2p through the relay, no bridge)."""
    channel = RelayedFrameChannel(stream)
    try:
        while (body := await channel.receive()) is not None:
            await channel.send(body)
        await channel.close()
    except (ProtocolError, RelayUnreachable):
        await channel.reset()


def _write_json(path: str, value: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshd.benchmarks.relay_home",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--listen", action="append", required=True)
    parser.add_argument("--relay", required=True, help="the relay's multiaddr, with /p2p/<id>")
    parser.add_argument("--worker", required=True,
                        help="this node's worker: unix:/path (its frame socket)")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--bench-echo", action="store_true",
                        help="also serve an echo protocol (the relay benchmark's libp2p floor)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    from pathlib import Path

    identity = load_or_create_identity(Path(args.data_dir))

    async def amain() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(run_home_node, identity, args.listen, args.relay, args.worker,
                                                  functools.partial(_write_json, args.ready_file),
                                                  bench_echo=args.bench_echo))
            print("ready", flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(amain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
