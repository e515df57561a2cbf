"""Every thread a worker, a route driver and a daemon start is joined when they stop: none is left.

Three real workers in this process (shard/edges/worker_edges.py: gRPC + TLS, the framed TLS port,
the Unix socket, the push hub), a tiny random Llama split A [0,2) B [2,4) C [4,6), and the daemon's
route driver in push topology, entering as A's node: A over its Unix socket, B over pinned TLS
gRPC (a control pump on B), C over the framed TLS port; A pushes to B over gRPC, B to C over
frames. Mid-decode -- pushed sessions live on every worker -- the workers are stopped: each stop
is clean (every thread joined within its bound), then the driver's generation is closed, and
the threads enumerated in this process are those from before the test.
"""
from __future__ import annotations

import re
import tempfile
import threading
from functools import partial
from pathlib import Path

import pytest
import torch

from meshd.cli.worker import push_dialer
from meshd.generate.driver import GenerationRequest
from meshd.generate.push import PushDriver
from meshd.generate.routes import AdsRouteSource, PeerConnector
from meshd.plan.adverts import ShardAd
from meshd.testing.experts import tls_files
from meshd.testing.models import build_random_llama
from shard.edges.worker_edges import WorkerEdges
from shard.model.reference import WholeModel
from shard.model.torch_backend import TorchRangeBackend
from shard.session.service import ShardService
from shard.session.sessions import SessionPolicy
from tests.conftest import wait_until_blocking

NUM_LAYERS = 6
PROMPT = tuple(range(5, 45))
NEW_TOKENS = 12
STOP_AFTER = 4
FAR_FUTURE_MS = 2**62
# Threads started by grpc's own client and server machinery end by themselves once their channel
# or server is closed; they get this long (a bound on the wait, not on the outcome).
LIBRARY_THREADS_END_S = 20.0
# trio's idle worker threads (trio/_core/_thread_cache.py): named so only while they run nothing.
IDLE_TRIO = re.compile(r"Trio thread \d+")
DAEMON_TEST_TIMEOUT_S = 100.0
# The thread-name prefixes of our groups (proto.threads: "<group>:<name>").
OURS = ("shard-", "route-", "hop-", "relayed-call", "frame-call", "expert")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_llama(seed=3)


def _start(model, start: int, end: int, tls, run_dir: Path) -> WorkerEdges:
    service = ShardService(TorchRangeBackend.load(model, start, end), SessionPolicy(kv_budget_tokens=4096))
    service.push_dialer = push_dialer
    return WorkerEdges(service, listen="127.0.0.1:0", tls_listen="127.0.0.1:0", tls_cert=str(tls.cert),
                       tls_key=str(tls.key), unix_listen=str(run_dir / f"w{start}.sock"),
                       frames_listen="127.0.0.1:0").start()


def _ad(peer_id: str, start: int, end: int, edges: WorkerEdges, tls) -> ShardAd:
    fp = edges.service.backend.fingerprint
    return ShardAd(peer_id=peer_id, model_digest=fp.model_artifact_digest, start=start, end=end,
                   num_layers=NUM_LAYERS, decode_ms_per_layer=1.0, prefill_tokens_per_s=100.0,
                   free_kv_tokens=4096, memory_budget_bytes=1 << 30, relayed=False,
                   expires_at_ms=FAR_FUTURE_MS, grpc_endpoint=edges.tls_listen, recipe_digest=fp.runtime_recipe_digest)


def _new_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


def test_workers_stopped_mid_generation_and_the_driver_leave_no_thread_alive(model, tmp_path):
    reference = WholeModel(model).generate(list(PROMPT), NEW_TOKENS, chunk_tokens=16).tokens
    before = set(threading.enumerate())
    tls = tls_files(tmp_path)
    run_dir = Path(tempfile.mkdtemp(prefix="owned-"))      # short: AF_UNIX paths are bounded
    spans = {"peer-a": (0, 2), "peer-b": (2, 4), "peer-c": (4, 6)}
    workers = {peer: _start(model, a, b, tls, run_dir) for peer, (a, b) in spans.items()}
    try:
        ads = [_ad(peer, *spans[peer], edges, tls) for peer, edges in workers.items()]
        fp = workers["peer-a"].service.backend.fingerprint
        source = AdsRouteSource(lambda: ads, fp.model_artifact_digest, NUM_LAYERS, entry_peer_id="peer-a",
                                recipe_digest=fp.runtime_recipe_digest)
        connector = PeerConnector(self_peer_id="peer-a", own_unix=workers["peer-a"].unix.endpoint,
                                  pins={"peer-b": tls.pin, "peer-c": tls.pin},
                                  frames={"peer-c": workers["peer-c"].frames.endpoint})
        driver = PushDriver(source, connector, fingerprint=fp, replan_wait_s=0.0, loop=False)
        generation = driver.generate(GenerationRequest(PROMPT, NEW_TOKENS, chunk_tokens=16))
        tokens = [next(generation).id for _ in range(STOP_AFTER)]
        assert tokens == reference[:STOP_AFTER] and driver.stats.routes[-1].peers == tuple(spans)
        live = {name.split(":")[-1].rstrip("0123456789-") for name in _new_threads(before)}
        # the test exercises every kind: gRPC handlers and a control pump (B), successor readers,
        # frame and Unix connections, the driver's watchdog and push readers
        assert {"rpc", "control-pump", "successor-read", "conn", "watchdog", "push-hop"} <= live, live
    finally:
        problems = {peer: edges.stop() for peer, edges in workers.items()}
    assert problems == {"peer-a": [], "peer-b": [], "peer-c": []}
    assert [n for n in _new_threads(before) if n.startswith(("shard-", "expert"))] == []   # joined by stop
    generation.close()                 # the driver fails its links over, releases, joins its threads
    assert [n for n in _new_threads(before) if n.startswith(OURS)] == []
    assert all(w.service.health().active_sessions == 0 for w in workers.values())   # released at stop
    assert _left_after_libraries(before) == []


def _left_after_libraries(before: set[threading.Thread], *, idle_trio_cache: bool = False) -> list[str]:
    """The new threads still alive once grpc's own have had time to end (a bounded wait). With
    ``idle_trio_cache``, trio's idle worker threads are not counted: trio keeps a finished
    ``to_thread`` worker for 10 s in case more work comes, named "Trio thread N" only while it
    runs nothing (a worker running a job carries the job's name)."""
    def left() -> list[str]:
        return [n for n in _new_threads(before) if not (idle_trio_cache and IDLE_TRIO.fullmatch(n))]

    try:
        wait_until_blocking(lambda: not left(), LIBRARY_THREADS_END_S, "grpc's own threads to end")
    except pytest.fail.Exception:
        pass                           # the assertion names what is left
    return left()


@pytest.mark.slow   # a real worker subprocess (startup ~20 s on 2 loaded cores): the slow step
def test_a_daemon_that_served_a_generation_leaves_no_thread_alive(model, tmp_path):
    """A daemon in this process (trio), its worker a real subprocess: one generation through the
    generate core (the driver in a trio thread, its Outbox, the worker's frame socket), then the
    daemon is cancelled. Its own threads are gone; grpc's client threads (the daemon's Health
    calls) end by themselves, trio's thread cache holds only idle workers; the worker exited 0."""
    import trio

    from meshd.config import ApiConfig, DaemonConfig, WorkerConfig
    from meshd.daemon.node import run_daemon
    from meshd.generate.params import GenerateParams
    from meshd.generate.service import NotReady, generate

    before = set(threading.enumerate())
    lines: list[str] = []
    events: list[dict] = []
    node_state: list = []
    config = DaemonConfig(data_dir=Path(tempfile.mkdtemp(prefix="owned-d-")), listen=("/ip4/127.0.0.1/tcp/0",),
                          model=model, layers=(0, NUM_LAYERS), reachability="public", record_ttl_s=30,
                          worker=WorkerConfig(torch_threads=1), api=ApiConfig(listen="off"))

    async def send(event: dict) -> None:
        events.append(event)

    async def main() -> None:
        with trio.fail_after(DAEMON_TEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                node = await nursery.start(partial(run_daemon, config, lines.append, handle_signals=False))
                node_state.append(node.supervisor.state)
                params = GenerateParams.from_request({"prompt": "the threads", "max_tokens": 6})
                while True:
                    try:
                        await generate(node.swarm, params, send)
                        break
                    except NotReady:              # the worker loads, the record propagates
                        await trio.sleep(0.2)
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert events[-1].get("done") and len(events[-1]["tokens"]) == 6
    # the worker stopped on the daemon's SIGTERM, joined all it started and returned from main
    assert node_state[0].last_exit == 0 and "worker: [worker] stopped" in lines, lines[-5:]
    assert [n for n in _new_threads(before) if n.startswith(OURS)] == []
    assert _left_after_libraries(before, idle_trio_cache=True) == []
