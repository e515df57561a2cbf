"""``meshd worker --experts``: the MoE sides of a worker.

Expert peer (``--experts SPEC --expert-listen HOST:PORT``, no ``--layers``)::

    meshd worker --model DIR --experts 0-3:E4-E7 --expert-listen 127.0.0.1:0 \\
                 --tls-cert FILE --tls-key FILE --ready-file FILE

Order: load only those experts (shard/experts/store.py) -> validate them with
a real forward -> listen (TLS; the node certificate whose hash the daemon
puts in its signed expert record) -> write the ready file ({"expert_listen",
"experts", "fingerprint", "validation", "weight_bytes", "pid"}) and print
"ready" -> serve until SIGTERM / SIGINT -> stop -> return from main.

The expert peer's process:

    main thread   load, validate, start the server, wait for a signal; then close it and exit
    ├── "expert"  SocketServer (shard/edges/expert_server.py): accept thread + one thread per
    │             holder connection (TLS), each computing under the one compute lock
    └── compute   torch's own pool, entered from the connection threads

Stop: ``ExpertServer.close()`` closes the listener, shuts every connection down and joins
every thread with a bound; main returns 0 (1 if a thread failed or outlived its bound). No
``os._exit``: nothing can block the stop once its sockets are shut down.

Holder (``--layers A:B --experts SPEC``): the range loads only SPEC's experts
of its sparse layers; the others run on expert peers named in
``--expert-peers FILE`` (JSON written by the daemon from the signed records
it reads in the DHT; shard/experts/pool.py). Before the validation forward
the worker waits (bounded by ``--expert-wait``) until every delegated
expert has a peer; afterwards it reloads the file as it changes.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from proto import moe as W
from proto.errors import MeshdError

# How often the holder looks at the daemon's placement file.
PEERS_RELOAD_S = 1.0
DEFAULT_EXPERT_WAIT_S = 600.0
STOP_POLL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixture of experts")
    group.add_argument("--experts", help="experts held, e.g. 0-3:E4-E7 (with --layers: of the range's MoE layers, "
                                         "the rest run on expert peers; without: serve them as an expert peer)")
    group.add_argument("--expert-listen", help="expert peer: HOST:PORT of the TLS expert exchange (port 0 = any)")
    group.add_argument("--expert-peers", help="holder: JSON file of expert peers (written by the daemon)")
    group.add_argument("--expert-act", choices=("f32", "q8"), default="f32",
                       help="holder: rows to expert peers as float32 (exact) or q8 blocks (~3.5x fewer bytes)")
    group.add_argument("--offload-experts", action="store_true",
                       help="holder: send held experts to peers too (compute stays the fallback)")
    group.add_argument("--expert-wait", type=float, default=DEFAULT_EXPERT_WAIT_S,
                       help="holder: seconds to wait for peers of the delegated experts before validating")


def _write_ready(path: str, payload: dict) -> None:
    tmp = Path(path).with_name(Path(path).name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the holder side


def holder_exchange(args: argparse.Namespace):
    """(held ExpertSpec | None, ExpertRouter | None) for a range worker."""
    if not args.experts and not args.expert_peers and not args.offload_experts:
        return None, None
    from shard.experts.pool import ExpertRouter
    from shard.experts.spec import ExpertSpec

    held = ExpertSpec.parse(args.experts) if args.experts else None
    # The digests the hello names are the loaded range's own (set by adopt_fingerprint after the load).
    router = ExpertRouter(artifact="", recipe="", act=W.ACT_Q8 if args.expert_act == "q8" else W.ACT_F32,
                          prefer_remote=bool(args.offload_experts))
    return held, router


def adopt_fingerprint(router, backend) -> None:
    """The router says hello with exactly the range's artifact and recipe digests."""
    router.artifact = backend.fingerprint.model_artifact_digest
    router.recipe = backend.fingerprint.runtime_recipe_digest


def wait_for_peers(backend, router, peers_file: str | None, timeout_s: float) -> None:
    """Block until every delegated expert of the range has a peer (or raise after ``timeout_s``)."""
    needed = backend.adapter.delegated(backend.layer_range)
    deadline = time.monotonic() + timeout_s
    last = ""
    told: set[str] = set()
    while True:
        if peers_file:
            router.load_file(peers_file)
        refused = router.probe()   # hello to each peer now, before any token
        for peer, why in refused.items():
            if why not in told:
                told.add(why)
                print(f"[worker] expert peer {peer}: {why}", file=sys.stderr, flush=True)
        missing = router.uncovered(needed)
        if not len(missing):
            return
        line = f"[worker] waiting for expert peers of {missing}"
        if line != last:
            print(line, file=sys.stderr, flush=True)
            last = line
        if time.monotonic() >= deadline:
            raise MeshdError(f"no expert peer serves {missing} after {timeout_s:g} s; start one with "
                             f"meshd join --model ... --experts {missing}")
        time.sleep(PEERS_RELOAD_S)


def reload_peers(router, peers_file: str | None) -> None:
    if router is not None and peers_file:
        try:
            router.load_file(peers_file)
        except (OSError, ValueError, KeyError) as exc:
            print(f"[worker] the expert peer file is unusable, keeping the last one: {exc}", file=sys.stderr)


# --------------------------------------------------------------------------- the expert peer side


def run_peer(args: argparse.Namespace) -> int:
    if not args.experts or not args.expert_listen:
        print("an expert peer needs --experts SPEC and --expert-listen HOST:PORT (or give --layers)", file=sys.stderr)
        return 2
    if not (args.tls_cert and args.tls_key):
        print("--expert-listen needs --tls-cert and --tls-key: expert peers speak TLS only", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    from shard.edges.expert_server import ExpertServer
    from shard.experts.spec import ExpertSpec, ExpertSpecError
    from shard.experts.store import ExpertStore

    try:
        spec = ExpertSpec.parse(args.experts)
        print(f"[worker] loading experts {spec} of {args.model}", file=sys.stderr, flush=True)
        store = ExpertStore.load(args.model, spec, dtype=args.dtype)
    except (OSError, ValueError, ExpertSpecError, MeshdError) as exc:
        print(f"cannot load experts {args.experts} of {args.model}: {exc}", file=sys.stderr)
        return 1
    print(f"[worker] validating {len(spec)} experts with a real forward", file=sys.stderr, flush=True)
    check = store.validate()
    if not check.ok:
        print(f"[worker] validation failed: {check.detail}", file=sys.stderr)
        return 1
    fp = store.fingerprint
    server = ExpertServer(store, artifact=fp.model_artifact_digest, recipe=fp.runtime_recipe_digest,
                          listen=args.expert_listen, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          threads=args.threads).start()
    from meshd.cli.common import ready_to_exit, stop_on_signals

    stop = stop_on_signals()
    try:
        if args.ready_file:
            _write_ready(args.ready_file, {
                "expert_listen": server.endpoint, "pid": os.getpid(), "experts": str(spec),
                "fingerprint": {"artifact": fp.model_artifact_digest, "recipe": fp.runtime_recipe_digest},
                "validation": {"ok": check.ok, "detail": check.detail, "experts": check.experts,
                               "ms_per_expert_row": check.ms_per_expert_row},
                "weight_bytes": store.weight_bytes, "versions": list(W.SUPPORTED_VERSIONS), "acts": list(W.ACTS)})
        print(f"ready experts {server.endpoint}", flush=True)
        while not stop:
            time.sleep(STOP_POLL_S)
    finally:
        problem = _close(server)
        ready_to_exit()
    if problem is not None:
        print(f"[worker] stopped with a problem: {_one_line(problem)} (details in the worker log)",
              file=sys.stderr, flush=True)
        return 1
    print(f"[worker] stopped; served {server.stats.as_dict()}", file=sys.stderr, flush=True)
    return 0


def _close(server) -> Exception | None:
    """Close the listener and every connection, join every thread (bounded); the problem, if any."""
    try:
        server.close()
    except Exception as exc:
        logging.getLogger("meshd.worker").error("stopping the expert server failed", exc_info=exc)
        return exc
    return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500] or type(exc).__name__
