"""The llama.cpp lane for Qwen3-MoE: qwen3moe GGUF ranges whose experts travel with their layer."""
from __future__ import annotations

import numpy as np
import pytest

from meshd.testing.models import build_random_qwen2_moe, build_random_qwen3_moe
from native.errors import ArtifactError
from native.gguf_range import model_info, open_reader, read_range
from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
from native.moe_gguf import convert_qwen3_moe
from native.slice import slice_path
from shard.model.backend import LayerRange
from tests._native_helpers import greedy_chain, max_logit_diff, ranges

pytestmark = pytest.mark.native

CONFIG = LlamaBackendConfig(n_threads=2, kv_budget_tokens=512, max_sessions=4)
PROMPT = list(range(5, 45))
N_NEW = 16
EXPERT_TENSORS = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}


@pytest.fixture(scope="module")
def ggufs():
    artifact = build_random_qwen3_moe()
    return artifact, {q: convert_qwen3_moe(artifact, q, progress=None) for q in ("F16", "F32")}


def _backends(path, layer_ranges):
    return [LlamaRangeBackend(path, r, CONFIG, progress=None) for r in layer_ranges]


@pytest.mark.parametrize("cuts", [[3], [2, 4]])
def test_qwen3moe_split_equals_whole(ggufs, cuts):
    _, files = ggufs
    whole = _backends(files["F16"], ranges([], 6))
    split = _backends(files["F16"], ranges(cuts, 6))
    try:
        a = greedy_chain(whole, PROMPT, N_NEW)
        b = greedy_chain(split, PROMPT, N_NEW)
    finally:
        for backend in whole + split:
            backend.close()
    diff = max_logit_diff(a, b)
    print(f"\nqwen3moe F16 cuts {cuts}: tokens equal={a.tokens == b.tokens} max|dlogit|={diff}")
    assert a.tokens == b.tokens and diff == 0.0
    assert len(set(a.tokens)) > 1


def test_a_slice_carries_exactly_its_layers_experts(ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_SLICE_CACHE", str(tmp_path))
    _, files = ggufs
    source = open_reader(files["F16"])
    info = model_info(source)
    assert (info.architecture, info.num_layers) == ("qwen3moe", 6)
    original = read_range(source, LayerRange(2, 4, 6))
    sliced = open_reader(slice_path(files["F16"], LayerRange(2, 4, 6), progress=None))
    names = {t.name for t in sliced.tensors}
    for offset in range(2):
        assert {f"blk.{offset}.{n}" for n in EXPERT_TENSORS} <= names
        for name in EXPERT_TENSORS:
            ours = next(t for t in sliced.tensors if t.name == f"blk.{offset}.{name}")
            assert np.array_equal(np.asarray(ours.data), np.asarray(original.blocks[offset][name].data))
    assert not any(n.startswith("blk.2.") for n in names)
    field = sliced.get_field("qwen3moe.expert_count")
    assert int(field.contents()) == 8


def test_llama_cpp_and_torch_agree_on_the_same_inputs(ggufs):
    """Across runtimes only the logits on the same inputs compare (random weights have near-tied logits)."""
    import shard.experts.adapters  # noqa: F401 - the MoE families register themselves
    from shard.model.torch_backend import TorchRangeBackend

    artifact, files = ggufs
    ll = LlamaRangeBackend(files["F32"], LayerRange(0, 6, 6), CONFIG, progress=None)
    tb = TorchRangeBackend.load(artifact, 0, 6, progress=None)
    try:
        ids = np.asarray(PROMPT, np.int64)
        a = ll.forward(ll.new_cache(64), ids, effective_start=0)
        b = tb.forward(tb.new_cache(64), ids, effective_start=0)
    finally:
        ll.close()
    diff = float(np.abs(a - b).max())
    print(f"\nqwen3moe F32 llama.cpp vs torch, same 40 tokens: max|dlogit|={diff}")
    assert int(a.argmax()) == int(b.argmax()) and diff < 0.05


def test_conversion_refuses_what_llama_cpp_would_run_differently():
    with pytest.raises(ArtifactError, match="norm_topk_prob"):
        convert_qwen3_moe(build_random_qwen3_moe(norm_topk_prob=False), progress=None)
    with pytest.raises(ArtifactError, match="qwen3_moe"):
        convert_qwen3_moe(build_random_qwen2_moe(), progress=None)


def test_the_torch_lane_over_gguf_refuses_qwen3moe(ggufs):
    from native.factory import load_gguf_backend

    with pytest.raises(ArtifactError, match="--backend llama.cpp"):
        load_gguf_backend(ggufs[1]["F16"], 0, 3, backend="torch", progress=None)
