"""``meshd bench NAME [--quick] [--json] [--model PATH] [--layers A:B,C:D] [--backend B]``.

Each benchmark is a module ``meshd.benchmarks.<name>`` exposing
``run(quick, progress, options) -> dict`` (``options``: the parsed arguments);
the result is printed as one JSON object. Benchmarks report ratios measured in
the same run, never absolute thresholds. ``swarm`` and ``pipeline`` time the
product (``meshd join`` daemons) and take the model options; the others
ignore them. ``dht --sim [--nodes N] [--seed S]`` runs the deterministic
simulation of the DHT (dht/kademlia/scenario.py) instead of real hosts.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

BENCHMARKS: dict[str, str] = {
    "codec": "meshd.benchmarks.codec",
    "swarm": "meshd.benchmarks.swarm",
    "pipeline": "meshd.benchmarks.pipeline",
    "recipes": "meshd.benchmarks.recipes",
    "relay": "meshd.benchmarks.relay",
    "moe": "meshd.benchmarks.moe",
    "api": "meshd.benchmarks.api",
    "serve": "meshd.benchmarks.serve",
    "dht": "meshd.benchmarks.dht_sim",
    "pool": "meshd.benchmarks.pool",
    "churn": "meshd.benchmarks.churn",
    "fetch": "meshd.benchmarks.fetch",
}
# Benchmarks that honour --model / --layers / --backend.
MODEL_OPTIONS = ("swarm", "pipeline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    parser.add_argument("--json", action="store_true",
                        help="print the result as one JSON line (progress stays on stderr)")
    parser.add_argument("--model", help="swarm, pipeline: a model artifact directory (default: SmolLM2-135M)")
    parser.add_argument("--layers", help="swarm, pipeline: a fixed split A:B,C:D,... (one daemon per range; "
                                         "default: swarm --layers auto, pipeline 2 and 3 even ranges)")
    parser.add_argument("--rtt-ms", type=float, dest="rtt_ms",
                        help="swarm: run the daemons in network namespaces with this round trip between them "
                             "(tc netem; root) and compare star with push (meshd/benchmarks/wan.py)")
    parser.add_argument("--backend", choices=("torch", "llama.cpp"), default="torch",
                        help="swarm, pipeline: the daemons' backend (default torch)")
    parser.add_argument("--lane", choices=("llama.cpp", "torch", "llama.cpp-shared"),
                        help="serve: run this lane only (default: all three, side by side)")
    parser.add_argument("--sim", action="store_true",
                        help="dht: the deterministic simulation on a virtual clock instead of real hosts")
    parser.add_argument("--nodes", type=int, help="dht --sim: simulated nodes (default 1000; --quick 200)")
    parser.add_argument("--seed", type=int, help="dht --sim: the seed every choice of the run derives from "
                                                 "(default 1; equal seeds give equal traces)")


def run(args: argparse.Namespace) -> int:
    from meshd.cli.common import fail
    from proto.errors import MeshdError

    if args.rtt_ms is not None and args.name != "swarm":
        return fail("only bench swarm takes --rtt-ms", 2)
    if args.name not in MODEL_OPTIONS and (args.model or args.layers or args.backend != "torch"):
        return fail(f"bench {args.name} takes no --model/--layers/--backend (only {', '.join(MODEL_OPTIONS)} do)", 2)
    if args.lane is not None and args.name != "serve":
        return fail("only bench serve takes --lane", 2)
    if args.sim and args.name != "dht":
        return fail("only bench dht takes --sim", 2)
    if (args.nodes is not None or args.seed is not None) and not args.sim:
        return fail("--nodes and --seed go with bench dht --sim", 2)
    if args.nodes is not None and args.nodes < 2:
        return fail("--nodes must be at least 2", 2)
    module = importlib.import_module(BENCHMARKS[args.name])
    try:
        # progress lines go to stderr in both modes: stdout carries only the result
        result = module.run(quick=args.quick, progress=sys.stderr, options=args)
    except MeshdError as exc:
        return fail(str(exc))
    print(json.dumps(result, indent=None if args.json else 2, sort_keys=True))
    return 0
