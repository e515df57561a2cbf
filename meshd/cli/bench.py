"""``meshd bench NAME [--quick] [--json]``: benchmarks that compare side by side.

Each benchmark is a module ``meshd.benchmarks.<name>`` exposing
``run(quick: bool) -> dict``; the result is printed as one JSON object.
Benchmarks report ratios measured in the same run, never absolute thresholds.
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
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[args.name])
    result = module.run(quick=args.quick, progress=None if args.json else sys.stderr)
    print(json.dumps(result, indent=None if args.json else 2, sort_keys=True))
    return 0
