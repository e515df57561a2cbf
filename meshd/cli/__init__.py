"""The ``meshd`` command line.

Each subcommand lives in its own module and registers itself here through
``SUBCOMMANDS``: a name -> (module path, one-line help). The module exposes
``add_arguments(parser)`` and ``run(args) -> int``. Heavy imports (torch,
libp2p, grpc) happen inside the subcommand module, so ``meshd --help`` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("meshd.cli.bench", "run a benchmark and print JSON (codec, pipeline, ...)"),
    "join": ("meshd.cli.join", "run the daemon: serve a layer range of a model in the swarm"),
    "status": ("meshd.cli.status", "show the local daemon: peers, own range, worker, coverage map"),
    "id": ("meshd.cli.id", "print this node's peer id"),
    "generate": ("meshd.cli.generate", "stream an answer from the swarm through the local daemon"),
    "demo": ("meshd.cli.demo", "start a local 3-node swarm on SmolLM2 and stream an answer"),
    "relay": ("meshd.cli.relay", "run relay mode on a public host: circuit relay v2 + DHT server"),
    "worker": ("meshd.cli.worker", "serve one layer range of a model over ShardRuntime gRPC"),
    "slice": ("meshd.cli.slice", "write a self-describing layer-range slice of a GGUF model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_path)
        module.add_arguments(sp)
        sp.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
