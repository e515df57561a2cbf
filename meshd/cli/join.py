"""``meshd join``: run the daemon in the foreground, serving a layer range of a model.

``--layers A:B`` serves a fixed range, ``--layers auto --memory SIZE`` one the tracker
assigns, ``--layers none`` nothing: a client-only node (DHT, control socket, HTTP API;
every hop of its generations is a remote peer's). ``--model`` names a file or directory
the node holds, or a model root (``merkle:<hex>``, ``NAME@merkle:<hex>``: ``meshd id
--model FILE`` prints it) whose range the node fetches from the peers that hold it.
"""
from __future__ import annotations

import argparse
import sys
import time

from meshd.cli.common import add_config_arguments, fail, first_meshd_error, setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model artifact directory or .gguf file, or a model root to fetch from "
                                        "peers: merkle:<hex> or NAME@merkle:<hex> (meshd id --model FILE prints it)")
    parser.add_argument("--layers", help="layer range A:B to serve (half-open), 'auto': the tracker assigns one, or "
                             "'none': a client-only node (no worker, no record; generates through the swarm)")
    parser.add_argument("--memory", help="memory this node offers with --layers auto, e.g. 4GiB: the whole node "
                                         "(daemon and worker at their peak, its weights' page cache included)")
    parser.add_argument("--listen", action="append", help="libp2p multiaddr to listen on (repeatable)")
    parser.add_argument("--bootstrap", nargs="+", action="extend", help="multiaddrs of peers to join through")
    parser.add_argument("--swarm", help="the swarm to join (default: 'default'): LAN discovery finds only its "
                             "nodes and the DHT talks only to them, so two households on one LAN stay apart")
    parser.add_argument("--no-mdns", action="store_false", dest="mdns", default=None,
                        help="do not announce this node or look for peers by mDNS on the LAN")
    parser.add_argument("--advertise-host", help="host or IP peers use to reach our TLS gRPC endpoint")
    parser.add_argument("--record-ttl", type=float, dest="record_ttl_s", help="lifetime of our DHT records, seconds")
    parser.add_argument("--refill-wait", type=float, dest="refill_wait_s",
                        help="seconds a generation waits for the tracker to refill layers that lost every "
                             "server (default: the record TTL + 60 s; 0: fail at once)")
    parser.add_argument("--reachability", choices=("auto", "public", "private"),
                        help="auto (default): probe whether peers can dial us and use relays if not; "
                             "private: always reserve on relays; public: never")
    parser.add_argument("--topology", choices=("push", "star"), dest="route_topology",
                        help="push (default): each hop sends its rows to the next (hops + 1 legs per token); "
                             "star: the entry carries every boundary (2 x hops)")
    parser.add_argument("--verify", metavar="RATE|all", dest="verify_rate",
                        help="re-run this share of each hop's steps on another replica and exclude a peer "
                             "that answered otherwise (default 0.03; all: every step, before its token is "
                             "streamed; 0: off). Star routes only for now")
    parser.add_argument("--speculative", choices=("off", "prompt-lookup", "draft-model"),
                        help="speculative decoding for generations entering here (star routes): prompt-lookup "
                             "drafts from the prompt and text so far, draft-model with --draft (default off)")
    parser.add_argument("--draft", metavar="MODEL.gguf", dest="draft_model",
                        help="a small GGUF with the served model's tokenizer that drafts tokens at this entry "
                             "(implies --speculative draft-model)")
    parser.add_argument("--api-listen", metavar="HOST:PORT|off",
                        help="the HTTP API, metrics and dashboard (default 127.0.0.1:8080; port 0: any free port); "
                             "beyond loopback it needs a key (--api-key-file or MESHD_API_KEY)")
    parser.add_argument("--api-key-file", metavar="PATH",
                        help="file whose first line is the bearer key the HTTP API requires (chmod 600; "
                             "or MESHD_API_KEY in the environment; at least 16 characters)")
    parser.add_argument("--api-key", help="the bearer key itself -- visible to every local user in ps: "
                                          "prefer --api-key-file or MESHD_API_KEY")
    parser.add_argument("--api-allow-host", action="append", metavar="NAME", dest="api_allowed_hosts",
                        help="a host name the API answers to besides IP addresses and localhost (repeatable); "
                             "other Host headers are refused (DNS rebinding)")
    parser.add_argument("--api-cors-origin", action="append", metavar="ORIGIN", dest="api_cors_origins",
                        help="a web origin (https://app.example) whose pages may call the API (repeatable; "
                             "CORS is off without it)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"))
    parser.add_argument("--backend", choices=("torch", "llama.cpp"))
    parser.add_argument("--kv-budget-tokens", type=int)
    parser.add_argument("--experts", help="MoE: the experts this node holds, e.g. 0-3:E4-E7 (layers 0..3, experts "
                                          "4..7). With --layers: of the range's layers (expert peers run the "
                                          "rest); without --layers: serve them as an expert peer; 'auto' "
                                          "(with --memory): the least served experts that fit")
    parser.add_argument("--expert-act", choices=("f32", "q8"),
                        help="rows to expert peers: f32 (exact, default) or q8 (~3.5x fewer bytes)")
    parser.add_argument("--offload-experts", action="store_true", default=None,
                        help="send even the experts this node holds to expert peers (local compute stays "
                             "the fallback)")
    parser.add_argument("--upload-limit", metavar="SIZE", dest="upload_limit",
                        help="bytes per second peers may fetch from us, e.g. 64MiB (0: unlimited; default 64MiB)")
    parser.add_argument("--upload-limit-busy", metavar="SIZE", dest="upload_limit_busy",
                        help="the same while our worker serves a generation (default 8MiB)")
    parser.add_argument("--threads", type=int,
                        help="the worker's compute threads (default: every core of this machine)")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v: our INFO and the libraries' warnings (repeats rate-limited); "
                             "-vv: DEBUG, py-libp2p's included")
    add_config_arguments(parser)


def _progress(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


API_KEY_ON_COMMAND_LINE = ("meshd: warning: --api-key puts the key on the command line, where every user of "
                           "this machine can read it (ps, /proc); use --api-key-file PATH or MESHD_API_KEY")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    if args.api_key:
        print(API_KEY_ON_COMMAND_LINE, file=sys.stderr, flush=True)
    try:
        from meshd.config import load_config, parse_layers
        from meshd.plan.modelinfo import check_layers, model_num_layers
        from meshd.sizes import parse_size

        overrides = {
            "data_dir": args.data_dir, "model": args.model,
            "layers": parse_layers(args.layers) if args.layers and args.layers not in ("auto", "none") else None,
            "auto_layers": True if args.layers == "auto" else None,
            "client_only": True if args.layers == "none" else None,
            "memory_bytes": parse_size(args.memory) if args.memory else None,
            "listen": tuple(args.listen) if args.listen else None,
            "bootstrap": tuple(args.bootstrap) if args.bootstrap else None,
            "swarm": args.swarm, "mdns": args.mdns,
            "advertise_host": args.advertise_host, "reachability": args.reachability, "record_ttl_s": args.record_ttl_s,
            "refill_wait_s": args.refill_wait_s,
            "route_topology": args.route_topology, "verify_rate": args.verify_rate,
            "speculative": args.speculative, "draft_model": args.draft_model,
            "worker.dtype": args.dtype, "worker.backend": args.backend,
            "worker.kv_budget_tokens": args.kv_budget_tokens, "worker.torch_threads": args.threads,
            "experts": args.experts, "expert_act": args.expert_act, "offload_experts": args.offload_experts,
            "api.listen": args.api_listen, "api.key": args.api_key, "api.key_file": args.api_key_file,
            "api.allowed_hosts": tuple(args.api_allowed_hosts) if args.api_allowed_hosts else None,
            "api.cors_origins": tuple(args.api_cors_origins) if args.api_cors_origins else None,
            "upload_bytes_per_s": args.upload_limit, "upload_busy_bytes_per_s": args.upload_limit_busy,
        }
        config = load_config(args.config, overrides)
        if not config.has_model:
            return fail("meshd join needs --model PATH and --layers A:B (or model/layers in --config)", 2)
        model = config.model
        if config.model_root is not None or model is None:
            layers = config.layers
            what = f"{layers[0]}:{layers[1]}" if layers is not None and not config.auto_layers \
                else "auto (asking the tracker)"
            _progress(f"model {config.model_name or ''}{'@' if config.model_name else ''}{config.model_root}: "
                      f"no local file; range {what}, fetched from the peers that hold it")
        elif config.client_only:
            num_layers = model_num_layers(model)
            _progress(f"model {config.model}: {num_layers} layers; client-only: holds none, "
                      "generates through the swarm")
        elif config.expert_peer:
            num_layers = model_num_layers(model)
            _progress(f"model {config.model}: {num_layers} layers; serving experts {config.experts} (expert peer)")
        elif config.auto_layers:
            num_layers = model_num_layers(model)
            _progress(f"model {config.model}: {num_layers} layers; range: auto (asking the tracker)")
        else:
            layers = config.layers
            assert layers is not None   # neither client-only, experts nor auto: the config requires --layers
            num_layers = check_layers(model, layers)
            _progress(f"model {config.model}: {num_layers} layers; serving {layers[0]}:{layers[1]}")
        import trio  # the daemon's imports (libp2p, grpc) take seconds: only after the checks

        from meshd.daemon.node import run_daemon

        setup_logging(args.verbose)  # again: importing libp2p reset its logger
        trio.run(run_daemon, config, _progress)
    except BaseException as exc:  # errors arrive wrapped in nursery exception groups
        ours = first_meshd_error(exc)
        if ours is not None:
            return fail(str(ours))
        if isinstance(exc, KeyboardInterrupt) or (
                isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None):
            print("meshd: interrupted", file=sys.stderr)
            return 130
        raise
    return 0
