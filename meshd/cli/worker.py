"""``meshd worker``: serve one layer range of one model over ShardRuntime gRPC.

    python -m meshd worker --model PATH --layers A:B --listen 127.0.0.1:PORT
        [--dtype float32|bfloat16] [--backend torch|llama.cpp] [--kv-budget-tokens N]
        [--tls-listen HOST:PORT --tls-cert FILE --tls-key FILE] [--frames-listen HOST:PORT]
        [--unix-listen PATH] [--ready-file FILE]
        [--experts SPEC --expert-peers FILE]         (MoE: hold only these experts)

Without ``--layers``, ``--experts SPEC --expert-listen HOST:PORT`` makes it an
expert peer instead (meshd/cli/expert_worker.py).

Order: import the backend's libraries (only those: the llama.cpp lane never
imports torch, ~200 MB of resident memory) and note the process's base ->
load the range (progress on stderr) -> validate it with a bounded real
forward and measure what the memory is made of (shard/model/memory.py: the
figures go into the capability report) -> listen -> write the ready file
({"listen", "tls_listen", "frames_tls", "unix", "pid"}, atomically) and print
one "ready" line on stdout -> serve until SIGTERM / SIGINT -> stop -> return
from main. Plaintext listens only on loopback; peers use the TLS port.

The process (every thread started through a ThreadGroup whose owner joins it; the main thread
owns them all, through WorkerEdges -- shard/edges/worker_edges.py -- and waits for them before
main returns):

    main thread   load, validate, start the edges, then sweep idle sessions and follow the
    │             expert peer file until a signal; then WorkerEdges.stop() and exit
    ├── gRPC      grpcio's own C-core threads; our handlers in its GroupExecutor "shard-rpc":
    │             one thread per call (the daemon's unary calls, peers' Session streams)
    ├── "shard-unix"     SocketServer: accept thread + one thread per connection (the daemon)
    ├── "shard-frames"   SocketServer: accept thread + one thread per connection (peers, TLS)
    ├── "shard-push"     the PushHub's: a reader per successor stream, a pump per pushed
    │                    control stream on gRPC
    └── compute          torch's / llama.cpp's own pools, entered from the threads above under
                         the service lock (shard/session/batching.py)

Stop (SIGTERM / SIGINT; the handler only appends to a list the main loop polls): the edges stop
in the order shard/edges/worker_edges.py gives -- listeners closed, live calls a short grace,
pushed sessions ended, connections shut down, every thread joined with a bound, sessions
released -- then main returns 0 (1 if a thread failed or outlived its bound: the worker log
names it). No ``os._exit`` and no watchdog: nothing native here can hang the stop (a forward in
progress ends with its compute; every blocking read is on a socket the stop shuts down), and
the daemon's SIGKILL after its grace stays the last resort.

Errors: stderr is the worker's log (shard/session/worklog.py: tracebacks marked so the
daemon keeps them in worker.log, off the user's terminal). A model that cannot
be loaded or validated ends the worker with exit code 1 and one clear last
line, ``cannot load MODEL layers A:B: why``; an unexpected exception logs its
traceback first.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import stat
import sys
import time
from pathlib import Path

from meshd.config import DEFAULT_KV_BUDGET_TOKENS, machine_cores
from proto.errors import MeshdError
from shard.session.sessions import DEFAULT_MAX_QUEUED_STEPS

log = logging.getLogger("meshd.worker")

# Idle sessions are swept this often even when no request arrives.
SWEEP_INTERVAL_S = 5.0
# How quickly SIGTERM is noticed by the main thread.
STOP_POLL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="artifact directory (config.json + safetensors) or .gguf")
    parser.add_argument("--layers", help="layer range A:B (B exclusive; 'A:' = to the end); omit with "
                        "--experts SPEC --expert-listen for an expert peer")
    parser.add_argument("--listen", default="127.0.0.1:0", help="loopback HOST:PORT for plaintext (port 0 = any)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--backend", choices=("torch", "llama.cpp"), default="torch")
    parser.add_argument("--kv-budget-tokens", type=int, default=DEFAULT_KV_BUDGET_TOKENS,
                        help="KV positions to admit sessions against (the planner sizes ranges with the same number)")
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--max-queued-steps", type=int, default=DEFAULT_MAX_QUEUED_STEPS,
                        help="refuse new sessions (RESOURCE_EXHAUSTED, retry hint) while this many steps "
                             "wait for the next batched forward")
    parser.add_argument("--ttl", type=float, default=300.0, help="seconds an idle session is kept")
    parser.add_argument("--min-idle-evict", type=float, default=2.0,
                        help="seconds a session must be idle before a newcomer may evict it")
    parser.add_argument("--threads", type=int, default=machine_cores(),
                        help="compute threads (default: every core this process may use)")
    parser.add_argument("--tls-listen", help="HOST:PORT for the TLS port peers dial")
    parser.add_argument("--tls-cert", help="PEM certificate for --tls-listen")
    parser.add_argument("--tls-key", help="PEM private key for --tls-listen")
    parser.add_argument("--unix-listen", help="also serve Session frames on this Unix socket (mode 0600; "
                        "the daemon's own link for relayed sessions)")
    parser.add_argument("--frames-listen", help="HOST:PORT of the framed fast path (Session frames over TLS, "
                        "the --tls-cert certificate; shard/edges/frame_server.py)")
    parser.add_argument("--ready-file", help="write {listen, tls_listen, unix, pid} JSON here once validated")
    parser.add_argument("--receipt-key", metavar="FILE",
                        help="sign step receipts with the key in FILE (written 0600 by the daemon; read, then "
                             "deleted)")
    parser.add_argument("--llama-kv-streams", type=_kv_streams, default="auto", metavar="N|auto",
                        help="llama.cpp KV layout: N = one stream of kv-budget/N tokens per session, at most N "
                             "sessions (bit-exact under concurrency); auto (default) = kv-budget/512 streams, at "
                             "most 8; 0 = one pool shared by all sessions (their tokens can drift from alone runs)")
    parser.add_argument("--slice-dir", type=Path,
                        help="llama.cpp: a directory of this node's own for its range's GGUF slice; a new range's "
                             "slice replaces the slices of other ranges of the model there (default: the shared "
                             "cache, ~/.cache/meshd/slices)")
    parser.add_argument("--no-batching", action="store_true",
                        help="run each session's forward alone (continuous batching is on by default)")
    parser.add_argument("--model-id", default="", help="human label reported in the capability")
    from meshd.cli import expert_worker

    expert_worker.add_arguments(parser)


def _kv_streams(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 0:
        raise ValueError("--llama-kv-streams must be auto or >= 0")
    return value


def _is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse_layers(text: str) -> tuple[int, int | None]:
    start_text, sep, end_text = text.partition(":")
    if not sep:
        raise ValueError(f"--layers must look like A:B, got {text!r}")
    return int(start_text or 0), (int(end_text) if end_text else None)


def uses_torch(args: argparse.Namespace) -> bool:
    """Whether this worker computes with torch (every lane but llama.cpp over a GGUF)."""
    return not (Path(args.model).suffix == ".gguf" and args.backend == "llama.cpp")


def import_backend_libraries(args: argparse.Namespace) -> None:
    """Import what the backend computes with before the base is measured, so that the base is
    the process without weights and the working memory is not inflated by library imports.
    transformers imports most of itself lazily, at the first config and model class it builds
    (~150 MB): the family's config and modeling modules are imported here for that reason."""
    if uses_torch(args):
        import importlib

        import torch

        torch.set_num_threads(args.threads)
        import transformers.modeling_utils  # noqa: F401

        import shard.model.torch_backend  # noqa: F401 - the adapters

        if Path(args.model).is_dir():
            from transformers import AutoConfig

            try:
                family = AutoConfig.from_pretrained(args.model).get_text_config(decoder=True).model_type
                importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            except Exception:  # noqa: BLE001 - the load reports a bad config; this only warms imports
                pass
    else:
        from native.llama_engine import load_llama_cpp

        load_llama_cpp()
        import native.llama_backend  # noqa: F401


def load_backend(args: argparse.Namespace, experts=None, exchange=None):
    """The RangeBackend named by the arguments (progress on stderr)."""
    start, end = _parse_layers(args.layers)
    if Path(args.model).suffix == ".gguf":  # llama.cpp or torch over GGUF: native's factory
        from native.factory import load_gguf_backend

        return load_gguf_backend(args.model, start, end, backend=args.backend, dtype=args.dtype,
                                 n_threads=args.threads, kv_budget_tokens=args.kv_budget_tokens,
                                 max_sessions=args.max_sessions, kv_streams=args.llama_kv_streams,
                                 progress=sys.stderr, slice_dir=args.slice_dir)
    if args.backend != "torch":
        raise ValueError("the llama.cpp backend serves .gguf files; use --backend torch for artifact directories")
    import shard.experts.adapters  # noqa: F401 - the MoE families register themselves (qwen3_moe, qwen2_moe)
    from shard.model.torch_backend import TorchRangeBackend

    return TorchRangeBackend.load(args.model, start, end, dtype=args.dtype, progress=sys.stderr,
                                  experts=experts, exchange=exchange)


def _write_ready(path: str, payload: dict) -> None:
    tmp = Path(path).with_name(Path(path).name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500] or type(exc).__name__


# A key file is ~200 bytes (proto/receipts.py); anything much larger is not one.
MAX_RECEIPT_KEY_FILE_BYTES = 4096


def read_receipt_key(path: Path):
    """The daemon's receipt key for this run (proto.receipts.ReceiptSigner): read once and unlinked;
    refused unless it is a regular file of ours that only we can read."""
    from dht.identity import peer_id_from_public_key
    from proto.receipts import ReceiptSigner

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{path} must be a regular file of this user, mode 0600")
        data = os.read(fd, MAX_RECEIPT_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return ReceiptSigner.from_key_file(data, peer_id_from_public_key)


def _load_and_validate(args: argparse.Namespace):
    """(service, router, None) once validated, or (None, None, the one-line reason it cannot serve)."""
    from meshd.cli import expert_worker
    from shard.model.memory import memory_figures, process_memory, reset_peak
    from shard.session.service import ShardService
    from shard.session.sessions import SessionPolicy
    from shard.session.worklog import LOG_ONLY

    try:
        import_backend_libraries(args)
        base = process_memory().rss
        held, router = expert_worker.holder_exchange(args)
        if router is not None and Path(args.model).suffix == ".gguf":
            raise ValueError("--experts with --layers needs the torch lane (an artifact directory)")
        backend = load_backend(args, held, router)
        reset_peak()   # what the load mapped and dropped is page cache, not the worker's (memory.py)
        if router is not None:
            expert_worker.adopt_fingerprint(router, backend)
            expert_worker.wait_for_peers(backend, router, args.expert_peers, args.expert_wait)
    except (OSError, ValueError, MeshdError) as exc:  # bad path, malformed file, wrong range
        log.info("loading %s layers %s failed", args.model, args.layers, exc_info=exc, extra=LOG_ONLY)
        return None, None, _one_line(exc)
    except Exception as exc:  # unexpected: the traceback goes to the log first
        log.error("loading %s layers %s failed", args.model, args.layers, exc_info=exc)
        return None, None, f"unexpected {type(exc).__name__}: {_one_line(exc)} (traceback in the worker log)"
    # llama.cpp holds at most its sequences (with per-session KV streams, the streams): the manager
    # admits and evicts idle sessions against that number, not a larger one the backend would refuse.
    sessions = min(args.max_sessions, getattr(backend, "session_capacity", args.max_sessions))
    policy = SessionPolicy(kv_budget_tokens=args.kv_budget_tokens, ttl_s=args.ttl, max_sessions=sessions,
                           min_idle_before_evict_s=args.min_idle_evict, max_queued_steps=args.max_queued_steps)
    service = ShardService(backend, policy, model_id=args.model_id or Path(args.model).name,
                           batching=not args.no_batching)
    print(f"[worker] validating layers {backend.layer_range} with a real forward", file=sys.stderr, flush=True)
    report = service.validate()
    if not report.validated:
        return None, None, report.detail
    figures = memory_figures(backend, base=base, peak=process_memory().peak, kv_budget_tokens=args.kv_budget_tokens,
                             validation_tokens=service.validation_tokens)
    service.record_memory(figures)
    mib = 1 << 20
    print(f"[worker] memory: weights {figures.weight_bytes / mib:.0f} MiB, KV {figures.kv_bytes / mib:.0f} MiB, "
          f"working {figures.working_bytes / mib:.0f} MiB, base {figures.worker_base_bytes / mib:.0f} MiB",
          file=sys.stderr, flush=True)
    return service, router, None


def push_dialer(target):
    """How this worker reaches the successor an entry named (push topology, shard/push/hub.py).

    The worker dials itself rather than through its daemon: the rows are here, and a detour
    through the daemon would add a process hop and a thread hand-off to every step. Only TLS
    pinned to the certificate hash the entry took from the target's signed record; a target
    without a pin is refused (relayed targets never get here: the entry drives those as a star).
    When the target names its framed fast path (``frames_endpoint``, same certificate), the
    stream goes there -- no gRPC threads between this hop's forward and the successor's --
    with the pinned gRPC port as the fallback (meshd/generate/transports.TlsFrameTransport).
    """
    from meshd.errors import ConfigError
    from meshd.generate.transports import GrpcTransport, TlsFrameTransport
    from meshd.reach.tls import pinned_channel
    from shard.edges.grpc_server import GRPC_OPTIONS

    pin = bytes(target.tls_cert_sha256)
    if len(pin) != 32:
        raise ConfigError(f"push target {target.peer_id[-12:]} carries no certificate pin; refusing to dial")
    endpoint = target.endpoint

    def grpc_transport() -> GrpcTransport:
        return GrpcTransport(pinned_channel(endpoint, pin, GRPC_OPTIONS))
    if target.frames_endpoint:
        return TlsFrameTransport(target.frames_endpoint, pin, grpc_transport)
    return grpc_transport()


def run(args: argparse.Namespace) -> int:
    from meshd.cli import expert_worker
    from shard.session import worklog

    worklog.install(sys.stderr)
    if args.layers is None:
        return expert_worker.run_peer(args)
    if not _is_loopback(args.listen):
        print(f"refusing plaintext on {args.listen}: --listen must be loopback; peers use --tls-listen",
              file=sys.stderr)
        return 2
    if (args.tls_listen or args.frames_listen) and not (args.tls_cert and args.tls_key):
        print("--tls-listen and --frames-listen need --tls-cert and --tls-key", file=sys.stderr)
        return 2
    from shard.edges.worker_edges import WorkerEdges

    service, router, failure = _load_and_validate(args)
    if service is None:
        print(f"cannot load {args.model} layers {args.layers}: {failure}", file=sys.stderr, flush=True)
        return 1
    service.push_dialer = push_dialer
    if args.receipt_key:
        try:
            service.receipts = read_receipt_key(Path(args.receipt_key))
        except (OSError, MeshdError) as exc:
            print(f"cannot use the receipt key {args.receipt_key}: {exc}", file=sys.stderr, flush=True)
            return 1
    edges = WorkerEdges(service, listen=args.listen, tls_listen=args.tls_listen, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, unix_listen=args.unix_listen, frames_listen=args.frames_listen)
    from meshd.cli.common import ready_to_exit, stop_on_signals

    stop = stop_on_signals()
    try:
        edges.start()
        if args.ready_file:
            _write_ready(args.ready_file, {**edges.ready(), "pid": os.getpid()})
        print(f"ready {edges.listen}" + (f" tls {edges.tls_listen}" if edges.tls_listen else ""), flush=True)
        serve_until(stop, service, router, args.expert_peers)
    finally:
        problems = edges.stop()
        ready_to_exit()
    return _stopped(problems)


def serve_until(stop: list[int], service, router, peers_file: str | None) -> None:
    """The main thread's loop: sweep idle sessions, follow the expert peer file, until a signal."""
    from meshd.cli import expert_worker

    last_sweep = time.monotonic()
    while not stop:
        time.sleep(STOP_POLL_S)   # short sleeps: signals are handled between them
        if time.monotonic() - last_sweep >= SWEEP_INTERVAL_S:
            with service.lock:
                service.manager.expire()
            last_sweep = time.monotonic()
        expert_worker.reload_peers(router, peers_file)


def _stopped(problems: list[BaseException]) -> int:
    """The exit status once every edge is stopped: 0 when every thread was joined and none failed."""
    if problems:
        print(f"[worker] stopped with {len(problems)} problem(s): "
              + "; ".join(_one_line(p) for p in problems[:4]) + " (details in the worker log)",
              file=sys.stderr, flush=True)
        return 1
    print("[worker] stopped", file=sys.stderr, flush=True)
    return 0
