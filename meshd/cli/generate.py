"""``meshd generate "prompt"``: stream an answer from the swarm through the local daemon.

The daemon is the entry node: it tokenizes, plans the route and drives it
(meshd/generate/service.py), through the same entry as its HTTP API
(meshd/api/entry.py: limits, metrics). This command only talks to its control socket and
prints text as it arrives; Ctrl-C closes the socket, which cancels the
generation and releases the KV on every hop.
"""
from __future__ import annotations

import argparse
import json
import sys

from meshd.cli.common import add_config_arguments, fail
from meshd.daemon.control import stream_events


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (a user message; --raw for plain text completion)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same answer)")
    parser.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    parser.add_argument("--json", action="store_true", help="print the event lines as they come")
    parser.add_argument("--logprobs", action="store_true", help="with --json: each token's log-probability")
    parser.add_argument("--top-logprobs", type=int, default=0, help="with --json: N (<= 20) likeliest alternatives")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from meshd.config import load_config
    from proto.errors import MeshdError

    request = {"op": "generate", "prompt": args.prompt, "max_tokens": args.max_tokens,
               "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
               "raw": args.raw, "logprobs": args.logprobs or args.top_logprobs > 0,
               "top_logprobs": args.top_logprobs}
    try:
        config = load_config(args.config, {"data_dir": args.data_dir})
        for event in stream_events(config.control_socket, request):
            if args.json:
                print(json.dumps(event), flush=True)
            elif "text" in event:
                sys.stdout.write(event["text"])
                sys.stdout.flush()
            elif event.get("done"):
                sys.stdout.write("\n")
                rate = event.get("decode_tokens_per_s")
                note = f"{len(event['tokens'])} tokens" + (f", {rate:.1f} tok/s" if rate else "")
                if event.get("failovers"):
                    note += f", {len(event['failovers'])} failover(s)"
                print(f"[{note}; route {' -> '.join(h.split(':')[0][-6:] for h in event['route'])}]",
                      file=sys.stderr)
    except KeyboardInterrupt:
        print("\n[cancelled]", file=sys.stderr)
        return 130
    except (MeshdError, OSError, ValueError) as exc:
        return fail(str(exc))
    return 0
