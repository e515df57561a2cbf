"""Fetch faults with real daemons on loopback (slow): a provider serving corrupted chunks, a fetching
node killed mid-download.

* A's model file rotted in place under its cached root (size and mtime kept: the digest cache, like
  make, does not notice), so A serves chunks that fail their hash. B (``--model ROOT --layers
  2:6``) detects it at the first bad chunk, blames A (its status says so; A's fetch port is never
  asked again), waits for another provider, completes from P (a good copy) and serves: its worker
  loaded only bytes that hash to the root (the daemon refuses a worker reporting another root).
* B fetches from A throttled to 1 MiB/s (``--upload-limit``), is SIGKILLed mid-download and started
  again on the same data directory: it resumes from its log, and A uploads nothing B had verified.
"""
from __future__ import annotations

import os

import pytest

from meshd.daemon.local_swarm import LocalSwarm, wait_for
from native.gguf_range import model_digest, open_reader
from native.slice import write_user_slice
from tests._fetch_swarm import KV_TOKENS, RECORD_TTL_S, START_TIMEOUT_S, fetch_port, last_fetch, range_tensor_bytes

pytestmark = pytest.mark.slow


def _model(**kw):
    from meshd.testing.gguf_models import build_random_gguf

    return build_random_gguf("llama", seed=31, hidden=256, ffn=768, heads=4, kv_heads=2, head_dim=64, **kw)


def _status(d) -> dict:
    return (d.query("status") or {}).get("fetch") or {}


def test_a_corrupting_provider_is_blamed_and_the_fetch_completes_from_another(tmp_path):
    source = _model()
    root = model_digest(source)              # cached by the file's stat: the rotten copy inherits it below
    rotten = tmp_path / "rotten.gguf"
    rotten.write_bytes(source.read_bytes())
    assert model_digest(rotten) == root
    st = rotten.stat()
    reader = open_reader(rotten)
    with open(rotten, "r+b") as fh:          # every tensor of layers 2..5 rots; layers 0..1 stay good
        for t in reader.tensors:
            if t.name.startswith(("blk.2.", "blk.3.", "blk.4.", "blk.5.")):
                fh.seek(t.offset + t.n_bytes // 2)
                fh.write(b"\x7f\x7f")
    del reader
    os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))
    (tmp_path / "swarm").mkdir()
    with LocalSwarm(tmp_path / "swarm", source, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S) as swarm:
        a = swarm.add(layers="0:2", model=rotten, name="a")
        swarm.wait_serving(a, START_TIMEOUT_S)
        a_id = a.swarm()["peer_id"]
        b = swarm.add(layers="2:6", model=root, name="b")
        blamed = wait_for(lambda: _status(b).get("blamed"), "b blames a", START_TIMEOUT_S, b)
        assert blamed == [a_id]
        assert "failed its hash" in b.text() and "never asked again" in b.text()
        asked = fetch_port(a)["requests"]
        p = swarm.add(layers="0:2", name="p")      # a good copy arrives
        swarm.wait_serving(b, START_TIMEOUT_S)
        f = last_fetch(b)
        assert fetch_port(a)["requests"] == asked             # never asked again for this model
        assert f["blamed"] == [a_id]
        assert f["peers"][p.swarm()["peer_id"]] == range_tensor_bytes(source, root, (2, 6))
        assert b.query("status")["own"]["model_digest"] == root
        slice_path = f["path"]
    good = write_user_slice(source, 2, 6, tmp_path / "cut.gguf", progress=None)
    assert open(slice_path, "rb").read() == good.read_bytes()   # not one rotten byte was kept


def test_a_fetch_killed_mid_download_resumes_without_fetching_verified_chunks_again(tmp_path):
    source = _model(layers=6)
    root = model_digest(source)
    need = range_tensor_bytes(source, root, (2, 6))
    with LocalSwarm(tmp_path, source, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S) as swarm:
        a = swarm.add(layers="0:2", name="a", extra=("--upload-limit", "1MiB", "--upload-limit-busy", "1MiB"))
        swarm.wait_serving(a, START_TIMEOUT_S)
        b = swarm.add(layers="2:6", model=root, name="b")

        def a_third():
            p = _status(b).get("fetching")
            return p if p and p["bytes_done"] > need // 3 else None
        before = wait_for(a_third, "a third of the range fetched", START_TIMEOUT_S, b)
        b.kill()                               # SIGKILL: no goodbye, the part and its log stay
        first_log = b.text()
        b = swarm.add(layers="2:6", model=root, name="b")   # the same data directory
        f = last_fetch(b)
        assert "resuming" in b.text()
        assert f["resumed_bytes"] >= before["bytes_done"] > 0
        # what the second run received: exactly the chunks not verified before the kill (+ 9-byte heads)
        assert f["bytes"] - f["resumed_bytes"] <= f["network_bytes"] <= f["bytes"] - f["resumed_bytes"] + 4096
        swarm.wait_serving(b, START_TIMEOUT_S)
        assert b.query("status")["own"]["model_digest"] == root
        assert "fetch layers 2:6" in first_log
