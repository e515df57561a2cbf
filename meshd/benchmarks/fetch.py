"""``meshd bench fetch``: a node fetches a >= 1 GiB layer range of a seeded GGUF from 1 and 2 providers.

In one run, on loopback, with every party a process of its own:

* ``floor``: a raw TLS socket stream of exactly the range's tensor bytes, from
  a sender process (the same file's bytes, memory-mapped) to this process,
  which only reads them -- no protocol, no hashing, no disk. Run before and
  after the fetches; the faster of the two is the floor. Its sending thread
  runs at the fetch port's priority (nice 19, as every upload thread of a
  provider does), so the machine's other load slows both senders alike.
* ``fetch_1`` / ``fetch_2``: the product's fetch (meshd/fetch/flow.py:
  RangeFetch into a fresh store) of the same range from one, then two
  provider processes (meshd/fetch/server.py over the whole file, unlimited
  rate): every chunk checked against the root on arrival, written in place
  into the slice, counted. Timed from the first request to the last chunk
  written; the final check of the whole slice against the root (what the
  worker would do on load, then cached) is reported apart as ``check_s``.
* ``inference``: a real ``meshd join`` daemon serving the quick model whole
  (torch lane) generates ``STEP_TOKENS`` greedy tokens, first idle, then
  while this process fetches the model from its fetch port over and over (the
  daemon's default upload limits: 64 MiB/s, 8 MiB/s while its worker has
  sessions; its upload threads at nice 19): the median decode step of each.
* ``bitswap``: py-libp2p 0.8.1's Bitswap between two meshd libp2p hosts
  (Noise, yamux) in this process, fetching ``BITSWAP_BYTES`` of 256 KiB
  blocks (its MAX_BLOCK_SIZE is 512 KiB): the other transport candidate.

Keys: fetch_mb_s_1, fetch_mb_s_2, floor_mb_s, fetch_vs_floor_2 (fetch_mb_s_2
/ floor_mb_s), bytes_over_range (bytes received on the links while fetching
the range, reply heads included / the range's tensor bytes), verified (both
slices hash to the model's root as a whole), range_bytes, check_s,
bitswap_mb_s, tls_vs_bitswap (fetch_mb_s_1 / bitswap_mb_s), step_ms_idle,
step_ms_serving (median decode step idle / while serving a fetch),
step_serving_vs_idle, serving_mb_s (what the fetch got meanwhile).

``python -m meshd.benchmarks.fetch serve MODEL CERT KEY PORT_FILE`` is a
provider; ``... stream MODEL START END CERT KEY PORT_FILE`` the floor's sender.
"""
from __future__ import annotations

import json
import mmap
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The range fetched: >= 1 GiB of F16 tensors (12 layers of a hidden-2048 Llama, ~94 MB each).
FULL: dict[str, Any] = {"hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128, "ffn": 5632, "layers": 14}
FULL_RANGE = (1, 13)
QUICK: dict[str, Any] = {"hidden": 1024, "heads": 8, "kv_heads": 4, "head_dim": 128, "ffn": 2816, "layers": 6}
QUICK_RANGE = (1, 5)
# Bitswap sample: its throughput is flat after a few MB; more only costs time.
BITSWAP_BYTES = 64 << 20
BITSWAP_BLOCK = 256 << 10
# Decode steps timed per generation (the median is reported).
STEP_TOKENS = 48
# Child processes print their port within this (a python start and an import of meshd).
CHILD_START_S = 120.0
READ_BYTES = 1 << 20


def _wait_port(port_file: Path, proc: subprocess.Popen) -> int:
    end = time.monotonic() + CHILD_START_S
    while time.monotonic() < end:
        if port_file.is_file() and port_file.read_text().strip():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"bench child exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError("bench child did not start")


def _child(args: list[str], tmp: Path, name: str) -> tuple[subprocess.Popen, int]:
    from meshd.testing.procs import child_env

    port_file = tmp / f"{name}.port"
    proc = subprocess.Popen([sys.executable, "-m", "meshd.benchmarks.fetch", *args, str(port_file)],
                            env=child_env(1), stdin=subprocess.DEVNULL)
    return proc, _wait_port(port_file, proc)


def _stop(proc: subprocess.Popen) -> None:
    from meshd.testing.procs import stop_process

    stop_process(proc)


# ---------------------------------------------------------------------------- children
def serve(model: str, cert: str, key: str, port_file: str) -> None:
    from meshd.fetch.holdings import Holdings, source_of_path
    from meshd.fetch.server import ChunkServer

    holdings = Holdings()
    holdings.add(source_of_path(Path(model)))
    server = ChunkServer(holdings, cert, key)
    Path(port_file).write_text(str(server.start()))
    try:
        threading.Event().wait()
    finally:
        server.stop()


def stream(model: str, start: str, end: str, cert: str, key: str, port_file: str) -> None:
    """The floor's sender: the range's tensor bytes, back to back, over one TLS connection."""
    from meshd.fetch.server import lower_priority, server_context
    from native.gguf_manifest import range_names
    from native.gguf_range import model_info, open_reader
    from shard.model.backend import LayerRange

    reader = open_reader(model)
    n = model_info(reader).num_layers
    names = set(range_names([t.name for t in reader.tensors], LayerRange(int(start), int(end), n)))
    spans = [(t.offset, t.n_bytes) for t in reader.tensors if t.name in names]
    ctx = server_context(cert, key)
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    Path(port_file).write_text(str(ls.getsockname()[1]))
    with open(model, "rb") as fh:
        view = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
    lower_priority()
    while True:
        conn, _ = ls.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        with ctx.wrap_socket(conn, server_side=True) as tls:
            for offset, size in spans:
                for at in range(offset, offset + size, READ_BYTES):
                    tls.sendall(view[at:min(at + READ_BYTES, offset + size)])


# ---------------------------------------------------------------------------- measurements
def _floor(port: int, total: int) -> float:
    from meshd.fetch.links import client_context

    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    buf = memoryview(bytearray(READ_BYTES))
    with client_context().wrap_socket(raw, server_hostname="meshd-peer") as tls:
        got, t0 = 0, time.perf_counter()
        while got < total:
            n = tls.recv_into(buf, min(READ_BYTES, total - got))
            if not n:
                raise RuntimeError("the floor's sender closed early")
            got += n
        return total / (time.perf_counter() - t0)


def _tls_link(peer: str, endpoint: str, pin: bytes, root: bytes) -> Callable[[], Any]:
    """A provider's link factory (meshd/fetch/fetcher.py Provider.connect)."""
    from meshd.fetch.links import TlsLink

    return lambda: TlsLink(peer, endpoint, pin, root)


def _fetch(data_dir: Path, root: str, layer_range, providers, stop: threading.Event | None = None) -> dict:
    from meshd.fetch.flow import RangeFetch, check_slice_root, get_manifest, get_meta
    from meshd.fetch.store import ModelStore

    stop = stop or threading.Event()
    store = ModelStore(data_dir, root)
    manifest = get_manifest(store, lambda: providers, stop)
    meta = get_meta(store, manifest, lambda: providers, stop)
    rf = RangeFetch(store, manifest, meta, layer_range)
    fetch = rf.open()
    links_before = 0
    for p in providers:
        fetch.add_provider(p)
    t0 = time.perf_counter()
    if not fetch.run(stop):
        if stop.is_set():
            return {"received": fetch.received_bytes(), "seconds": time.perf_counter() - t0}
        raise RuntimeError("the fetch stopped")
    seconds = time.perf_counter() - t0
    received = fetch.received_bytes() - links_before
    path = rf.target.finish()
    t1 = time.perf_counter()
    check_slice_root(path, root)
    check = time.perf_counter() - t1
    return {"seconds": seconds, "bytes": fetch.sched.total_bytes, "received": received, "check_s": check,
            "peers": {k: v["bytes"] for k, v in fetch.progress()["peers"].items()}}


def _bitswap(total: int) -> float:
    import trio
    from libp2p.bitswap import CODEC_RAW, BitswapClient, compute_cid_v1
    from libp2p.peer.peerinfo import PeerInfo

    from dht.host.build import running_host
    from dht.identity import Identity

    result: list[float] = []

    async def main() -> None:
        ids = Identity.from_seed(b"\x01" * 32), Identity.from_seed(b"\x02" * 32)
        async with running_host(ids[0], ["/ip4/127.0.0.1/tcp/0"]) as a, \
                running_host(ids[1], ["/ip4/127.0.0.1/tcp/0"]) as b, trio.open_nursery() as nursery:
            provider, client = BitswapClient(a), BitswapClient(b)
            for c in (provider, client):
                c.set_nursery(nursery)
                await c.start()
            cids: list[Any] = []
            for i in range(total // BITSWAP_BLOCK):
                data = i.to_bytes(8, "little") * (BITSWAP_BLOCK // 8)
                cid = compute_cid_v1(data, codec=CODEC_RAW)
                cids.append(cid)
                await provider.add_block(cid, data)
            await b.connect(PeerInfo(a.get_id(), a.get_addrs()))
            t0 = time.perf_counter()
            got = await client.new_session().get_blocks_batch(cids, peer_id=a.get_id(), timeout=600)
            result.append(len(got) * BITSWAP_BLOCK / (time.perf_counter() - t0))
            await provider.stop()
            await client.stop()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return result[0]


def _inference(model: Path, tmp: Path, say) -> dict:
    """Decode step times of a daemon serving ``model`` whole, idle and while peers fetch from it."""
    import statistics

    from meshd.daemon.local_swarm import LocalSwarm, wait_for
    from meshd.fetch.fetcher import Provider
    from meshd.fetch.links import TlsLink
    from native.gguf_range import model_info, open_reader
    from shard.model.backend import LayerRange
    from shard.model.manifest import parse_root

    n = model_info(open_reader(model)).num_layers
    (tmp / "swarm").mkdir()
    with LocalSwarm(tmp / "swarm", model, kv_budget_tokens=512, backend="torch") as swarm:
        node = swarm.add(layers=f"0:{n}")
        swarm.wait_serving(node, 600)
        status = wait_for(lambda: (s := node.query("status")) and s["fetch"].get("endpoint") and s, "fetch port", 60)
        root, pin = status["own"]["model_digest"], bytes.fromhex(status["own"]["tls_cert_sha256"])
        provider = Provider("node", lambda: TlsLink("node", status["fetch"]["endpoint"], pin, parse_root(root)))

        def steps() -> float:
            done = next(e for e in node.generate("the swarm answers", max_tokens=STEP_TOKENS, raw=True)
                        if e.get("done"))
            return statistics.median(done["step_wall_ms"][1:])

        steps()   # warm up
        idle = min(steps(), steps())
        stop, fetched, rounds = threading.Event(), [0], [0]

        def pull() -> None:
            while not stop.is_set():
                out = _fetch(tmp / f"pull{rounds[0]}", root, LayerRange(0, n, n), [provider], stop=stop)
                shutil.rmtree(tmp / f"pull{rounds[0]}", ignore_errors=True)
                fetched[0] += out["received"]
                rounds[0] += 1

        puller = threading.Thread(target=pull)
        puller.start()
        t0 = time.perf_counter()
        try:
            wait_for(lambda: fetched[0] or (status := node.query("status")) and
                     status["fetch"]["server"].get("bytes_sent", 0) > 0 or None, "the fetch to start", 60)
            serving = statistics.median([steps(), steps()])
        finally:
            stop.set()
            puller.join()
        sent = (node.query("status") or {}).get("fetch", {}).get("server", {}).get("bytes_sent", 0)
        rate = sent / (time.perf_counter() - t0)
    say(f"decode step idle {idle:.2f} ms, while serving a fetch {serving:.2f} ms (upload {rate / 1e6:.1f} MB/s)")
    return {"step_ms_idle": round(idle, 3), "step_ms_serving": round(serving, 3),
            "step_serving_vs_idle": round(serving / idle, 3), "serving_mb_s": round(rate / 1e6, 1)}


def run(quick: bool, progress, options=None) -> dict:
    from meshd.fetch.fetcher import Provider
    from meshd.reach.tls import load_or_create_tls
    from meshd.testing.gguf_models import build_random_gguf
    from native.gguf_range import model_digest, model_info, open_reader
    from shard.model.backend import LayerRange
    from shard.model.manifest import parse_root

    def say(line: str) -> None:
        print(f"[bench fetch] {line}", file=progress, flush=True)

    params, (start, end) = (QUICK, QUICK_RANGE) if quick else (FULL, FULL_RANGE)
    say(f"the seeded model ({params['layers']} layers, hidden {params['hidden']}; built once, cached)")
    model = build_random_gguf("llama", seed=7, **params)
    root = model_digest(model, progress)
    n = model_info(open_reader(model)).num_layers
    layer_range = LayerRange(start, end, n)
    tmp = Path(tempfile.mkdtemp(prefix="meshd-bench-fetch-"))
    procs: list[subprocess.Popen] = []
    try:
        tls = load_or_create_tls(tmp / "tls", "bench-provider")
        cert, key = str(tls.cert_path), str(tls.key_path)
        servers = []
        for i in range(2):
            proc, port = _child(["serve", str(model), cert, key], tmp, f"provider{i}")
            procs.append(proc)
            servers.append(Provider(f"provider{i}", _tls_link(f"provider{i}", f"127.0.0.1:{port}", tls.sha256,
                                                              parse_root(root))))
        sender, sport = _child(["stream", str(model), str(start), str(end), cert, key], tmp, "floor")
        procs.append(sender)
        first = _fetch(tmp / "warm", root, layer_range, servers[:1])   # warms the page cache and the code
        shutil.rmtree(tmp / "warm")
        total = first["bytes"]
        say(f"range {start}:{end}: {total / 2**30:.2f} GiB of tensors")
        floors = [_floor(sport, total)]
        say(f"floor (raw TLS stream): {floors[-1] / 1e6:.0f} MB/s")
        one = _fetch(tmp / "one", root, layer_range, servers[:1])
        shutil.rmtree(tmp / "one")
        say(f"fetch from 1 provider: {total / one['seconds'] / 1e6:.0f} MB/s")
        two = _fetch(tmp / "two", root, layer_range, servers)
        shutil.rmtree(tmp / "two")
        say(f"fetch from 2 providers: {total / two['seconds'] / 1e6:.0f} MB/s ({two['peers']})")
        floors.append(_floor(sport, total))
        say(f"floor again: {floors[-1] / 1e6:.0f} MB/s")
        bitswap = _bitswap(BITSWAP_BYTES // (4 if quick else 1))
        say(f"bitswap (py-libp2p 0.8.1, 256 KiB blocks): {bitswap / 1e6:.1f} MB/s")
        for proc in procs:
            _stop(proc)
        procs.clear()
        say("a daemon generating, idle and while peers fetch from it (the quick model, torch lane)")
        inference = _inference(build_random_gguf("llama", seed=7, **QUICK), tmp, say)
    finally:
        for proc in procs:
            _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    floor = max(floors)
    f1, f2 = total / one["seconds"], total / two["seconds"]
    return {
        "range_bytes": total, "range": [start, end], "num_layers": n,
        "fetch_mb_s_1": round(f1 / 1e6, 1), "fetch_mb_s_2": round(f2 / 1e6, 1),
        "floor_mb_s": round(floor / 1e6, 1), "fetch_vs_floor_2": round(f2 / floor, 3),
        "bytes_over_range": round(max(one["received"], two["received"]) / total, 5),
        "verified": True,   # _fetch raised unless both slices hash to the root as a whole
        "check_s": round(max(one["check_s"], two["check_s"]), 2),
        "providers_share_2": {k: round(v / total, 3) for k, v in two["peers"].items()},
        "bitswap_mb_s": round(bitswap / 1e6, 1), "tls_vs_bitswap": round(f1 / bitswap, 1),
        **inference,
    }


def main(argv: list[str]) -> int:
    if argv and argv[0] == "serve":
        serve(*argv[1:])
    elif argv and argv[0] == "stream":
        stream(*argv[1:])
    else:
        print(json.dumps(run(quick="--quick" in argv, progress=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
