"""Fetching a layer range over the real fetch port (pinned TLS on loopback) from real model files.

Providers are real ChunkServers over real GGUF files / model directories; the fetch is the
product's (meshd/fetch/flow.py). Checks: the range's slice is byte for byte what ``meshd slice``
writes and proves against the model's root; only the range's bytes cross the link; a provider
whose file rotted under its cached root is blamed at its first bad chunk and the fetch completes
from another; a stopped fetch resumes without asking again for a verified chunk (and re-checks
what its bitmap claims); a safetensors range loads in the torch backend and computes what the
whole directory computes; the protocol's decoders refuse garbage with typed errors."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from conftest import wait_until_blocking
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.fetch import wire
from meshd.fetch.fetcher import Provider
from meshd.fetch.flow import RangeFetch, get_manifest, get_meta
from meshd.fetch.holdings import Holdings, source_of_path
from meshd.fetch.links import TlsLink
from meshd.fetch.server import ChunkServer
from meshd.fetch.store import ModelStore
from meshd.reach.tls import load_or_create_tls
from meshd.testing.gguf_models import build_random_gguf
from native.gguf_range import model_digest, open_reader
from native.slice import write_user_slice
from proto.errors import LimitExceeded, PayloadCorrupt, ProtocolError
from shard.model.backend import LayerRange
from shard.model.manifest import parse_root


@pytest.fixture()
def tls(tmp_path):
    return load_or_create_tls(tmp_path / "tls", "provider")


class Peer:
    """A provider: a real ChunkServer on loopback over ``paths``."""

    def __init__(self, name: str, paths, tls, root: str) -> None:
        self.name, self.root = name, root
        self.holdings = Holdings()
        for p in paths:
            self.holdings.add(source_of_path(p))
        self.server = ChunkServer(self.holdings, str(tls.cert_path), str(tls.key_path))
        self.port = self.server.start()
        self.provider = Provider(name, lambda: TlsLink(name, f"127.0.0.1:{self.port}", tls.sha256, parse_root(root)))

    def close(self) -> None:
        self.server.stop()
        self.holdings.close()


def _fetch(data_dir: Path, root: str, layer_range: LayerRange, peers, stop=None, on_blame=None):
    store = ModelStore(data_dir, root)
    stop = stop or threading.Event()
    providers = lambda: [p.provider for p in peers]   # noqa: E731
    manifest = get_manifest(store, providers, stop)
    meta = get_meta(store, manifest, providers, stop)
    rf = RangeFetch(store, manifest, meta, layer_range, on_blame=on_blame)
    return rf, rf.run(providers, stop)


def test_a_range_fetched_is_the_slice_meshd_slice_writes(tmp_path, tls):
    source = build_random_gguf("llama", seed=11)
    root = model_digest(source)
    peer = Peer("a", [source], tls, root)
    try:
        rf, path = _fetch(tmp_path / "data", root, LayerRange(2, 5, 6), [peer])
    finally:
        peer.close()
    assert model_digest(path) == root
    assert path.read_bytes() == write_user_slice(source, 2, 5, tmp_path / "cut.gguf", progress=None).read_bytes()
    p = rf.fetch.progress()
    reader = open_reader(path)
    tensor_bytes = sum(t.n_bytes for t in reader.tensors)
    assert p["bytes_total"] == tensor_bytes        # the range, no more: its tensors, plus a 9-byte head per run
    assert tensor_bytes < rf.fetch.received_bytes() <= tensor_bytes + 9 * len(open_reader(path).tensors)
    assert peer.server.bytes_sent < tensor_bytes + reader.data_offset + 4096                # + metadata, headers


def test_a_rotten_provider_is_blamed_at_its_first_bad_chunk_and_the_fetch_completes_elsewhere(tmp_path, tls):
    source = build_random_gguf("llama", seed=12)
    root = model_digest(source)
    rotten = tmp_path / "rotten.gguf"
    rotten.write_bytes(source.read_bytes())
    model_digest(rotten)                        # its root is computed and cached ...
    st0 = rotten.stat()
    reader = open_reader(rotten)
    with open(rotten, "r+b") as fh:             # ... then every tensor of layer 3 rots in place,
        for t in reader.tensors:
            if t.name.startswith("blk.3."):
                fh.seek(t.offset)
                fh.write(bytes(b ^ 0x5A for b in fh.read(4)))
    del reader
    os.utime(rotten, ns=(st0.st_atime_ns, st0.st_mtime_ns))   # size and mtime as cached: it still claims the root
    bad = Peer("bad", [rotten], tls, root)
    blamed = []
    stop = threading.Event()
    result = {}

    def run():
        try:
            result["out"] = _fetch(tmp_path / "data", root, LayerRange(3, 6, 6), peers, stop,
                                   on_blame=lambda *a: blamed.append(a))
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    peers = [bad]                               # the providers the fetch knows, read again every second
    thread = threading.Thread(target=run)
    thread.start()
    good = None
    try:
        wait_until_blocking(lambda: blamed, 60, "the rotten provider blamed")
        (peer, entry, chunk), = blamed
        assert peer == "bad" and entry.startswith("blk.3.") and chunk == 0
        good = Peer("good", [source], tls, root)
        peers.append(good)                      # the fetch waits for a provider, then completes
        thread.join(120)
    finally:
        stop.set()
        thread.join()
        bad.close()
        if good is not None:
            good.close()
    assert "error" not in result, result.get("error")
    rf, path = result["out"]
    assert model_digest(path) == root and rf.fetch.blamed == ["bad"]
    assert rf.fetch.progress()["peers"]["good"]["bytes"] > 0


def test_a_stopped_fetch_resumes_without_asking_again_for_verified_chunks(tmp_path, tls):
    source = build_random_gguf("llama", seed=13, hidden=256, ffn=512)   # a few MB: many chunks
    root = model_digest(source)
    peer = Peer("a", [source], tls, root)
    store = ModelStore(tmp_path / "data", root)
    providers = lambda: [peer.provider]   # noqa: E731
    try:
        stop = threading.Event()
        manifest = get_manifest(store, providers, stop)
        meta = get_meta(store, manifest, providers, stop)
        first = RangeFetch(store, manifest, meta, LayerRange(0, 6, 6))
        fetch = first.open()
        halfway = first.target.wanted[len(first.target.wanted) // 2]
        real_mark = first.target.mark

        def mark(entry, chunk):
            real_mark(entry, chunk)
            if (entry, chunk) == halfway:
                stop.set()                                   # "killed" mid-download
        first.target.mark = mark
        with pytest.raises(Exception, match="stopped"):
            first.run(providers, stop)
        got_before = fetch.sched.verified_bytes
        assert 0 < got_before < fetch.sched.total_bytes and first.target.bitmap_path.is_file()
        # a torn write: a chunk the bitmap vouches for is damaged on disk
        torn = next(k for k in first.target.wanted if first.target.verified(*k))
        fd = os.open(first.target.part, os.O_RDWR)
        where = first.target.dests[torn[0]].offset
        os.pwrite(fd, b"\xff\xfe", where)
        os.close(fd)
        # the stopped fetch's connections end before the count is read: a reply still being sent
        # when it stopped counts against the first fetch, not the second
        wait_until_blocking(lambda: peer.server.status()["connections"] == 0, 30, "the stopped fetch's links to close")
        sent_before = peer.server.bytes_sent
        second = RangeFetch(store, manifest, meta, LayerRange(0, 6, 6))
        fetch2 = second.open()
        assert second.target.rechecked_bad == 1
        path = second.run(providers, threading.Event())
    finally:
        peer.close()
    torn_len = manifest.chunk_span(*torn)[1]
    assert fetch2.sched.resumed_bytes == got_before - torn_len
    assert peer.server.bytes_sent - sent_before == fetch2.sched.total_bytes - fetch2.sched.resumed_bytes
    assert model_digest(path) == root


def test_a_safetensors_range_loads_and_computes_as_the_whole_directory(tmp_path, tls):
    import numpy as np

    from meshd.testing.models import build_random_llama
    from shard.model.st_manifest import dir_manifest, held_layers, model_root
    from shard.model.torch_backend import TorchRangeBackend

    source = build_random_llama(seed=5)
    root = model_root(source)
    peer = Peer("a", [source], tls, root)
    try:
        rf, path = _fetch(tmp_path / "data", root, LayerRange(3, 6, 6), [peer])
    finally:
        peer.close()
    assert path.is_dir() and model_root(path) == root and held_layers(path) == (3, 6, 6)
    whole_bytes = sum(e.size for e in dir_manifest(source).entries)
    assert rf.fetch.received_bytes() < whole_bytes * 0.7          # layers 3..5 + the head's output, not all
    part = TorchRangeBackend.load(path, 3, 6, progress=None)
    full = TorchRangeBackend.load(source, 3, 6, progress=None)
    assert part.fingerprint.model_artifact_digest == full.fingerprint.model_artifact_digest == root
    x = np.random.default_rng(0).standard_normal((4, part.sub_config.hidden_size)).astype(np.float32)
    a = part.forward(part.new_cache(16), x, effective_start=3)
    b = full.forward(full.new_cache(16), x, effective_start=3)
    assert np.array_equal(a, b)


@given(st.binary(max_size=2 * wire.REQUEST_BYTES))
@settings(max_examples=300)
def test_requests_decode_or_fail_typed(raw):
    for data in (raw, raw[:wire.REQUEST_BYTES].ljust(wire.REQUEST_BYTES, b"\0"),
                 b"MF\x01" + raw[:wire.REQUEST_BYTES - 3].ljust(wire.REQUEST_BYTES - 3, b"\0")):
        try:
            req = wire.decode_request(data)
        except ProtocolError:
            continue
        assert wire.decode_request(wire.encode_request(req)) == req


@given(st.binary(min_size=wire.REPLY_HEAD_BYTES, max_size=wire.REPLY_HEAD_BYTES), st.sampled_from(list(wire.Op)))
def test_reply_heads_decode_or_fail_typed(raw, op):
    try:
        head = wire.decode_reply_head(raw, op=op, expect=1024)
    except ProtocolError:
        return
    assert head.status != wire.Status.OK or head.length == 1024


def test_reply_bounds_are_checked_before_the_body():
    with pytest.raises(LimitExceeded):
        wire.decode_reply_head(wire.encode_reply_head(wire.Status.OK, wire.MAX_RUN_BYTES + 1), op=wire.Op.CHUNKS)
    with pytest.raises(PayloadCorrupt):
        wire.decode_reply_head(wire.encode_reply_head(wire.Status.OK, 10), op=wire.Op.CHUNKS, expect=11)
