"""Weights from peers, end to end: real ``meshd join`` daemons on loopback (slow; llama.cpp: native too).

Node A holds the only copy of a model and serves layers 0:2. B and C start with ``--model ROOT
--layers auto --memory M`` (M below the model's size): they find A in the DHT, take the manifest
and metadata from it, ask A (the tracker) for a range, fetch only that range's chunks, write a
slice and serve it. Then:

* the swarm covers every layer and its greedy tokens equal the whole model's, on the same runtime;
* each of B and C received at most 1.05 x the bytes of the tensors it serves, and A sent at most
  that for both plus the manifest and metadata each of them took once (the "header");
* B and C's records offer what they fetched (a fetch port, their layers), so a later joiner
  could fetch from them.

Both lanes and both artifact kinds: a safetensors directory on the torch lane, a GGUF on llama.cpp.
"""
from __future__ import annotations

import pytest

from meshd.daemon.local_swarm import LocalSwarm
from tests._fetch_swarm import (
    KV_TOKENS,
    PROMPT,
    RECORD_TTL_S,
    START_TIMEOUT_S,
    fetch_port,
    generate,
    last_fetch,
    meta_bytes,
    range_tensor_bytes,
    split_memory,
)

pytestmark = pytest.mark.slow

N_TOKENS = 16


def _run(tmp_path, model, root, memory, extra=()) -> tuple[dict, dict, dict, int]:
    with LocalSwarm(tmp_path, model, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S, extra=extra) as swarm:
        a = swarm.add(layers="0:2", name="a")
        swarm.wait_serving(a, START_TIMEOUT_S)
        b = swarm.add(layers="auto", memory=memory, model=root, name="b")
        swarm.wait_serving(b, START_TIMEOUT_S)
        c = swarm.add(layers="auto", memory=memory, model=root, name="c")
        swarm.wait_serving(c, START_TIMEOUT_S)
        view = swarm.wait_covered(60, peers=3)
        done = generate(a, PROMPT, N_TOKENS)
        fb, fc = last_fetch(b), last_fetch(c)
        sent = fetch_port(a).get("bytes_sent", 0)
        ads = {x["peer_id"]: (x["start"], x["end"]) for x in view["ads"]}
        print("\nassigned:", sorted(ads.values()), "route:", done["route"], "fetched:",
              [(f["layers"], f["network_bytes"], f["bytes"]) for f in (fb, fc)], "A sent", sent)
        status_b = b.query("status")
    return done, {"b": fb, "c": fc}, status_b, sent


def _check_bytes(model, root, fetched: dict, sent: int) -> None:
    total = 0
    for name, f in fetched.items():
        need = range_tensor_bytes(model, root, tuple(f["layers"]))
        assert f["bytes"] == need, name
        assert need <= f["network_bytes"] <= 1.05 * need, name     # the range's tensors, not one more
        total += need
    assert sent <= 1.05 * total + 2 * meta_bytes(model)           # what A uploaded in all


def test_torch_lane_safetensors_b_and_c_fetch_only_their_ranges(tmp_path):
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.plan.footprint import artifact_footprint
    from meshd.testing.models import build_random_llama
    from shard.model.reference import WholeModel
    from shard.model.st_manifest import model_root

    model = build_random_llama(seed=8, hidden_size=256, intermediate_size=768)
    root = model_root(model)
    fp = artifact_footprint(model, root, "float32")
    memory = split_memory(fp, KV_TOKENS, (2, 4), (4, 6))
    # --memory is the whole node (processes' base included): below what one node needs for every layer
    assert memory < fp.range_bytes(0, fp.num_layers, KV_TOKENS), "M must be below what the model needs"
    done, fetched, status_b, sent = _run(tmp_path, model, root, memory)
    torch.set_num_threads(1)
    tok = EntryTokenizer(model)
    expected = WholeModel(model).generate(tok.encode_prompt(PROMPT, raw=True), N_TOKENS).tokens
    assert done["tokens"] == expected[:len(done["tokens"])] and len(done["route"]) == 3
    assert sorted(tuple(f["layers"]) for f in fetched.values()) == [(2, 4), (4, 6)]
    _check_bytes(model, root, fetched, sent)
    own = status_b["own"]
    assert own["model_digest"] == root and status_b["fetch"]["endpoint"]     # B serves what it fetched


@pytest.mark.native
def test_llama_cpp_lane_gguf_b_and_c_fetch_only_their_ranges(tmp_path):
    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.plan.footprint import gguf_footprint
    from meshd.testing.gguf_models import build_random_gguf
    from native.gguf_range import model_digest
    from native.llama_reference import reference_generate

    model = build_random_gguf("llama", seed=9, hidden=256, ffn=768, heads=4, kv_heads=2, head_dim=64)
    root = model_digest(model)
    fp = gguf_footprint(model, root, "llama.cpp")
    memory = split_memory(fp, KV_TOKENS, (2, 4), (4, 6))
    assert memory < fp.range_bytes(0, fp.num_layers, KV_TOKENS)   # below one node for every layer (base included)
    done, fetched, _, sent = _run(tmp_path, model, root, memory, extra=("--backend", "llama.cpp"))
    tok = EntryTokenizer(model)
    expected = list(reference_generate(model, tok.encode_prompt(PROMPT, raw=True), N_TOKENS, n_threads=2,
                                       stop_ids=tok.stop_ids).tokens)
    assert done["tokens"] == expected[:len(done["tokens"])] and len(done["route"]) == 3
    _check_bytes(model, root, fetched, sent)
