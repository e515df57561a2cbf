"""From one file to a running swarm on a LAN: mDNS finds the peers, B and C fetch only their ranges.

Three network namespaces on one bridge (tests/_lan_netns.py: a home LAN, no route out); every
daemon runs ``meshd join`` with the network defaults -- all interfaces, port 4001, no
``--advertise-host`` and no ``--bootstrap`` anywhere -- once on the llama.cpp lane with a GGUF
(native), once on the torch lane with a safetensors directory:

  * A holds the only copy of the seeded model and serves layers 0:2;
  * B and C hold nothing: ``--model ROOT --layers auto --memory M``, M below the model's size.

B and C find A by mDNS, read the model's records, take the manifest and metadata from A, are
assigned 2:4 and 4:6 by A (the tracker), fetch them from A's fetch port on its LAN address and
serve them. The swarm covers every layer, its greedy tokens equal whole-model llama.cpp on the
same file and runtime, and each of B and C received at most 1.05 x the bytes of the tensors it serves (the
manifest and metadata, fetched once, besides). If namespaces cannot be created the test FAILS.
"""
from __future__ import annotations

import time

import pytest

from meshd.daemon.local_swarm import wait_for
from tests._fetch_swarm import KV_TOKENS, PROMPT, range_tensor_bytes, split_memory
from tests._lan_netns import new_lan
from tests._netns import NetnsUnavailable
from tests.test_mdns_netns import LanDaemon

pytestmark = pytest.mark.netns

WAIT_S = 120
NEW_TOKENS = 12


def _gguf():
    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.plan.footprint import gguf_footprint
    from meshd.testing.gguf_models import build_random_gguf
    from native.gguf_range import model_digest
    from native.llama_reference import reference_generate

    model = build_random_gguf("llama", seed=9, hidden=256, ffn=768, heads=4, kv_heads=2, head_dim=64)
    root = model_digest(model)
    fp = gguf_footprint(model, root, "llama.cpp")

    def expected() -> list[int]:
        tok = EntryTokenizer(model)
        return list(reference_generate(model, tok.encode_prompt(PROMPT, raw=True), NEW_TOKENS, n_threads=1,
                                       stop_ids=tok.stop_ids).tokens)
    return model, root, fp, ("--backend", "llama.cpp"), expected


def _safetensors():
    import torch

    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.plan.footprint import artifact_footprint
    from meshd.testing.models import build_random_llama
    from shard.model.reference import WholeModel
    from shard.model.st_manifest import model_root

    model = build_random_llama(seed=8, hidden_size=256, intermediate_size=768)
    root = model_root(model)

    def expected() -> list[int]:
        torch.set_num_threads(1)
        tok = EntryTokenizer(model)
        tokens = WholeModel(model).generate(tok.encode_prompt(PROMPT, raw=True), NEW_TOKENS).tokens
        cut = next((i for i, t in enumerate(tokens) if t in tok.stop_ids), None)
        return tokens if cut is None else tokens[:cut + 1]
    return model, root, artifact_footprint(model, root, "float32"), ("--backend", "torch"), expected


@pytest.mark.parametrize("lane", [pytest.param("llama.cpp-gguf", marks=pytest.mark.native), "torch-safetensors"])
def test_b_and_c_find_a_by_mdns_and_fetch_only_their_ranges(tmp_path, lane):
    model, root, fp, backend, reference = _gguf() if lane == "llama.cpp-gguf" else _safetensors()
    memory = split_memory(fp, KV_TOKENS, (2, 4), (4, 6))
    lan = new_lan(3)
    daemons: list[LanDaemon] = []
    flags = (*backend, "--kv-budget-tokens", str(KV_TOKENS))
    started = time.monotonic()
    try:
        try:
            lan.up()
        except NetnsUnavailable as exc:
            pytest.fail(f"cannot build the LAN: {exc}")
        a = LanDaemon(tmp_path, "A", model, prefix=lan.prefix(1), layers="0:2", extra=flags)
        daemons.append(a)
        a_id = a.peer_id()
        for i, name in ((2, "B"), (3, "C")):
            daemons.append(LanDaemon(tmp_path, name, root, prefix=lan.prefix(i), layers="auto",
                                     extra=(*flags, "--memory", str(memory))))
        b, c = daemons[1:]
        expected = reference()
        view = wait_for(lambda: (v := a.swarm()) and (v.get("coverage") or {}).get("fully_covered")
                        and len(v["ads"]) == 3 and v, "B and C to fetch and serve the gap", WAIT_S, a)
        assert sorted((x["start"], x["end"]) for x in view["ads"]) == [(0, 2), (2, 4), (4, 6)], view["ads"]
        done = None
        for event in a.generate(PROMPT, max_tokens=NEW_TOKENS, raw=True):
            if event.get("done"):
                done = event
        assert done is not None and done["tokens"] == expected and len(done["route"]) == 3, (done, expected)
        for node in (b, c):
            st = node.status()
            f = st["fetch"]["last_fetch"]
            need = range_tensor_bytes(model, root, tuple(f["layers"]))
            assert f["bytes"] == need and need <= f["network_bytes"] <= 1.05 * need, (node.name, f)
            # A held the only copy; once C (or B) serves a range it fetched, it is a provider too, and
            # "local" is chunks the node already held from an earlier range (re-verified)
            assert a_id in f["peers"] and set(f["peers"]) - {"local"} <= {a_id, b.peer_id(), c.peer_id()}, f
            assert st["own"]["model_digest"] == root
            assert any(p["peer_id"] == a_id for p in st["discovery"]["mdns"]["peers"])   # found by mDNS
        print(f"LAN ({lane}): B and C fetched "
              f"{[node.status()['fetch']['last_fetch']['network_bytes'] for node in (b, c)]} bytes and the swarm "
              f"generated in {time.monotonic() - started:.1f} s")
    finally:
        for node in reversed(daemons):
            node.stop()
        lan.down()
