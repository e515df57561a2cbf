"""Process orchestration for relay benchmarks and end-to-end tests (real processes only).

Every child is ``[sys.executable, "-m", ...]`` with PYTHONPATH starting at this
checkout's root, optionally behind a ``prefix`` such as
``["ip", "netns", "exec", "home1"]``, and becomes ready by writing a JSON
ready file (waited for with a bound; an early exit fails at once).

    spawn_relay        meshd relay                       -> {peer_id, addrs}
    spawn_worker       meshd worker (shard)              -> {listen, pid}
    spawn_home_node    python -m meshd.benchmarks.relay_home -> {peer_id, relayed_addrs, verdict}
    drive(...)         the entry node: a libp2p host in a LoopThread (relay/portal.py), circuits to
                       the relayed hops, the route driver (SwarmDriver) over a fixed
                       route of mixed hops
    python -m meshd.benchmarks.relay_harness drive SPEC.json OUT.json
                       the same, as a child (inside a namespace)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshd.testing import procs

REPO_ROOT = Path(__file__).resolve().parents[2]
# Loading a model or starting libp2p on a loaded 2-core machine: bounded, generous.
READY_TIMEOUT_S = 300.0
# The entry driver keeps at most this many relayed request bodies (for the capture check).
KEEP_SENT_BODIES = 64


def child_env(threads: int = 1) -> dict[str, str]:
    return procs.child_env(threads)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    ready: dict = field(default_factory=dict)
    log: Path | None = None
    ready_path: Path | None = None
    check: Callable[[dict], bool] | None = None
    scratch: Path | None = None     # a private directory of this child's, removed at stop()

    def stop(self) -> int | None:
        code = procs.stop_process(self.proc)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return code

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log and self.log.exists() else ""


def spawn_ready(name: str, args: Sequence[str], ready: Path, *, prefix: Sequence[str] = (),
                timeout_s: float = READY_TIMEOUT_S, check=None, wait: bool = True) -> Child:
    """Start ``python -m <args>``; unless ``wait=False``, wait until it is ready (see ``wait_ready``)."""
    log = ready.with_suffix(".log")
    cmd = [*prefix, sys.executable, "-m", *args]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=err)
    child = Child(name, proc, log=log, ready_path=ready, check=check)
    if wait:
        wait_ready(child, timeout_s)
    return child


def wait_ready(child: Child, timeout_s: float = READY_TIMEOUT_S) -> Child:
    """Wait until the child's ready file exists (and its check holds); stop it on failure."""
    deadline = time.monotonic() + timeout_s
    ready_path = child.ready_path
    assert ready_path is not None   # spawn_ready names it
    try:
        while True:
            if ready_path.exists():
                child.ready = json.loads(ready_path.read_text())
                if child.check is None or child.check(child.ready):
                    return child
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode} before it was ready: "
                                   f"{child.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not ready after {timeout_s:.0f}s: {child.tail()}")
            time.sleep(0.05)
    except BaseException:
        child.stop()
        raise


def spawn_relay(workdir: Path, listen: str, *, prefix: Sequence[str] = ()) -> Child:
    d = workdir / "relay"
    d.mkdir(parents=True, exist_ok=True)
    return spawn_ready("relay", ["meshd", "relay", "--listen", listen, "--data-dir", str(d),
                                 "--ready-file", str(d / "ready.json")], d / "ready.json", prefix=prefix)


def spawn_worker(workdir: Path, model: Path, layers: str, *, prefix: Sequence[str] = (), threads: int = 1,
                 wait: bool = True) -> Child:
    d = Path(tempfile.mkdtemp(prefix=f"worker-{layers.replace(':', '-')}-", dir=workdir))
    # Unix socket paths are limited to ~108 bytes: a short private dir of its own (0700).
    scratch = Path(tempfile.mkdtemp(prefix="mw-"))
    try:
        child = spawn_ready(f"worker {layers}", ["meshd", "worker", "--model", str(model), "--layers", layers,
                                                 "--listen", "127.0.0.1:0", "--threads", str(threads),
                                                 "--unix-listen", str(scratch / "w.sock"),
                                                 "--ready-file", str(d / "ready.json")], d / "ready.json",
                            prefix=prefix, wait=wait)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    child.scratch = scratch
    return child


def spawn_home_node(workdir: Path, name: str, listen: str, relay_addr: str, worker: str, *,
                    prefix: Sequence[str] = (), bench_echo: bool = False) -> Child:
    d = workdir / name
    d.mkdir(parents=True, exist_ok=True)
    return spawn_ready(name, ["meshd.benchmarks.relay_home", "--listen", listen, "--relay", relay_addr,
                              "--worker", worker, "--data-dir", str(d), "--ready-file", str(d / "ready.json"),
                              *(["--bench-echo"] if bench_echo else [])], d / "ready.json",
                       prefix=prefix, check=lambda r: bool(r.get("relayed_addrs")))


# ------------------------------------------------------------------ the entry node

class _RecordedStream:
    """A relayed hop's stream whose request bodies go through ``record(body)`` first."""

    def __init__(self, inner, record) -> None:
        self._inner, self._record = inner, record

    def send(self, body: bytes, timeout_s: float | None = None) -> None:
        self._record(body)
        self._inner.send(body, timeout_s)

    def receive(self):
        return self._inner.receive()

    def close_send(self) -> None:
        self._inner.close_send()

    def cancel(self) -> None:
        self._inner.cancel()


class _RecordedTransport:
    def __init__(self, inner, sent: list[bytes], on_sent=None) -> None:
        self._inner, self._sent, self._on_sent = inner, sent, on_sent
        self.kind = inner.kind

    def open_session(self):
        count = [0]

        def record(body: bytes) -> None:
            count[0] += 1
            if len(self._sent) < KEEP_SENT_BODIES:
                self._sent.append(bytes(body))
            if self._on_sent is not None:
                self._on_sent(count[0])
        return _RecordedStream(self._inner.open_session(), record)

    def unary(self, method, body: bytes, timeout_s: float) -> bytes:
        return self._inner.unary(method, body, timeout_s)

    def close(self) -> None:
        self._inner.close()


def _recording_factory(factory, sent: list[bytes], on_sent=None):
    """Wrap a transport factory so relayed hops keep their first request bodies (bounded)."""
    def wrap(endpoint: str):
        transport = factory(endpoint)
        return _RecordedTransport(transport, sent, on_sent) if endpoint.startswith("p2p:") else transport
    return wrap


def drive(spec: dict, on_sent=None) -> dict:
    """Run one generation as the entry node (the product's SwarmDriver over a fixed route). ``spec``:

    {"hops": [{"endpoint": "127.0.0.1:P" | "p2p:<peer id>", "start", "end", "num_layers"}],
     "relayed": {"<peer id>": "<relayed multiaddr>"},
     "prompt": [ids], "max_new_tokens": n, "chunk_tokens": c, "return_logits": false}
    Returns {"tokens", "logits" (lists; with return_logits), "prefill_s", "decode_s", "hop_execution_ns"
    (decode compute per hop, as the workers report it), "step_wall_ns" (each decode step),
    "tail_bytes_per_decode_step", "sent_bodies_hex"}. A failed hop raises RouteFailed (its
    HopFailure is the cause). ``on_sent(n)`` is called as the n-th request body leaves for a
    relayed hop (fault injection).
    """

    import multiaddr
    import trio

    from dht.host.build import build_host
    from dht.identity import Identity
    from meshd.generate.driver import GenerationRequest, SwarmDriver
    from meshd.generate.routes import FactoryConnector, discover_fingerprint, fixed_route
    from meshd.generate.transports import GrpcTransport
    from meshd.reach.tls import loopback_channel
    from relay.client import dial_relayed, parse_relayed_addr
    from relay.portal import LoopThread
    from relay.syncchannel import relayed_transport_factory
    from shard.edges.grpc_server import GRPC_OPTIONS

    async def setup(task_status=trio.TASK_STATUS_IGNORED):
        host = build_host(Identity.from_seed(os.urandom(32)))
        async with host.run([multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/0")]):
            for addr in spec.get("relayed", {}).values():
                relay, dest = parse_relayed_addr(addr)
                await dial_relayed(host, relay, dest)
            task_status.started(host)
            await trio.sleep_forever()

    hops = spec["hops"]
    source = fixed_route([(h["endpoint"], h["start"], h["end"]) for h in hops], hops[0]["num_layers"])
    sent: list[bytes] = []
    request = GenerationRequest(tuple(spec["prompt"]), spec["max_new_tokens"],
                                chunk_tokens=spec.get("chunk_tokens", 128),
                                return_logits=spec.get("return_logits", False))
    with LoopThread(setup, name="relay-entry") as loop:
        assert loop.portal is not None   # __enter__ returns once setup has started

        def direct(endpoint: str) -> GrpcTransport:
            return GrpcTransport(loopback_channel(endpoint, GRPC_OPTIONS))
        connector = FactoryConnector(_recording_factory(relayed_transport_factory(loop.portal, loop.value, direct),
                                                        sent, on_sent))
        driver = SwarmDriver(source, connector, fingerprint=discover_fingerprint(connector, source.route))
        tokens = [t.id for t in driver.generate(request)]
    stats = driver.stats
    times = stats.token_times
    return {"tokens": tokens, "logits": [row.tolist() for row in stats.logits],
            "prefill_s": stats.prefill_s, "decode_s": times[-1] - times[0] if len(times) > 1 else 0.0,
            "hop_execution_ns": list(stats.hop_execution_ns),
            "step_wall_ns": list(stats.step_wall_ns),
            "tail_bytes_per_decode_step": stats.tail_bytes_per_decode_step,
            "sent_bodies_hex": [b.hex() for b in sent]}


def relayed_echo_rtts(relayed_addr: str, *, frame_bytes: int, count: int) -> list[float]:
    """Round trips (ms) of one ``frame_bytes`` frame to a ``--bench-echo`` home node through its relay,
    timed inside the trio loop: libp2p (Noise + yamux, both hosts and the relay) and nothing of ours
    beyond the framing -- the floor under a relayed decode step."""
    import multiaddr
    import trio

    from dht.host.build import build_host
    from dht.identity import Identity
    from meshd.benchmarks.relay_home import ECHO_PROTOCOL
    from relay.client import dial_relayed, parse_relayed_addr
    from relay.transport import RelayedFrameChannel

    async def main() -> list[float]:
        host = build_host(Identity.from_seed(os.urandom(32)))
        async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            relay, dest = parse_relayed_addr(relayed_addr)
            await dial_relayed(host, relay, dest)
            channel = RelayedFrameChannel(await host.new_stream(dest, [ECHO_PROTOCOL]))
            body, rtts = os.urandom(frame_bytes), []
            for _ in range(count + 1):          # the first one warms up
                t0 = time.perf_counter()
                await channel.send(body)
                if await channel.receive() != body:
                    raise RuntimeError("the echo node answered with other bytes")
                rtts.append((time.perf_counter() - t0) * 1e3)
            await channel.close()
            return rtts[1:]
    return trio.run(main)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "drive":
        print("usage: python -m meshd.benchmarks.relay_harness drive SPEC.json OUT.json", file=sys.stderr)
        return 2
    out = drive(json.loads(Path(args[1]).read_text()))
    tmp = args[2] + ".tmp"
    Path(tmp).write_text(json.dumps(out))
    os.replace(tmp, args[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
