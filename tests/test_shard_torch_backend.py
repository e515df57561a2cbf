"""Range loading and exact split execution in one process (torch backend)."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

from meshd.testing import models as testmodels
from shard.model.adapters import UnsupportedArchitecture, adapter_for
from shard.model.backend import BackendCache, RangeBackend
from shard.model.reference import WholeModel
from shard.model.torch_backend import BackendInputError, TorchRangeBackend
from tests._shard_helpers import max_diff, run_split

torch.set_num_threads(1)
PROMPT = list(range(5, 45))


@pytest.mark.parametrize("builder", [testmodels.build_random_llama, testmodels.build_random_gemma3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_way_split_equals_whole_model(builder, dtype):
    path = builder()
    ref = WholeModel(path, dtype).generate(PROMPT, 12, chunk_tokens=16)
    parts = [TorchRangeBackend.load(path, a, b, dtype=dtype, progress=None) for a, b in ((0, 2), (2, 5), (5, 6))]
    tokens, logits = run_split(parts, PROMPT, 12, chunk=16)
    diff = max_diff(logits, ref.logits)
    print(f"{builder.__name__} {dtype}: max abs logit diff {diff}")
    assert tokens == ref.tokens
    assert diff == 0.0


@pytest.mark.parametrize("builder", [testmodels.build_random_llama, testmodels.build_random_gemma3])
def test_overlapping_ranges_with_effective_start(builder):
    path = builder()
    ref = WholeModel(path).generate(PROMPT, 6, chunk_tokens=16)
    parts = [TorchRangeBackend.load(path, a, b, progress=None) for a, b in ((0, 4), (2, 6))]
    tokens, logits = run_split(parts, PROMPT, 6, chunk=16, effective=[0, 4])
    assert tokens == ref.tokens and max_diff(logits, ref.logits) == 0.0


def test_protocol_conformance_and_boundary_dtypes():
    path = testmodels.build_random_llama()
    head = TorchRangeBackend.load(path, 0, 3, dtype="bfloat16", progress=None)
    assert isinstance(head, RangeBackend)
    cache = head.new_cache(16)
    assert isinstance(cache, BackendCache)
    out = head.forward(cache, np.array([1, 2, 3], dtype=np.int64), effective_start=0)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == (3, head.hidden_size)
    assert cache.past_len == 3
    assert head.boundary_dtype == np.dtype(ml_dtypes.bfloat16)
    assert head.fingerprint.model_artifact_digest.startswith("merkle:")   # the model root


def test_only_the_range_is_loaded():
    path = testmodels.build_random_llama()
    whole = TorchRangeBackend.load(path, 0, 6, progress=None)
    middle = TorchRangeBackend.load(path, 2, 4, progress=None)
    assert middle.modules.embed is None and middle.modules.lm_head is None
    assert len(middle.modules.layers) == 2
    assert middle.weight_bytes < whole.weight_bytes / 2


def test_tied_embeddings_share_storage():
    path = testmodels.build_random_gemma3()
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"]
    whole = TorchRangeBackend.load(path, 0, 6, progress=None)
    assert whole.modules.embed.weight.data_ptr() == whole.modules.lm_head.weight.data_ptr()


def test_bad_inputs_are_typed_errors():
    path = testmodels.build_random_llama()
    mid = TorchRangeBackend.load(path, 2, 4, progress=None)
    cache = mid.new_cache(4)
    h = mid.hidden_size
    bad = [
        (np.zeros((2, h), np.float32), 0),  # effective_start outside range
        (np.zeros((2, h), np.float16), 2),  # wrong dtype
        (np.zeros((2, h + 1), np.float32), 2),  # wrong width
        (np.zeros((0, h), np.float32), 2),  # empty
        (np.zeros((5, h), np.float32), 2),  # over capacity
    ]
    for inputs, eff in bad:
        with pytest.raises(BackendInputError):
            mid.forward(cache, inputs, effective_start=eff)
    assert cache.past_len == 0
    head = TorchRangeBackend.load(path, 0, 2, progress=None)
    with pytest.raises(BackendInputError):
        head.forward(head.new_cache(4), np.array([10_000], np.int64), effective_start=0)
    with pytest.raises(BackendInputError):
        head.new_cache(0)


def test_wrong_range_and_unknown_architecture(tmp_path):
    path = testmodels.build_random_llama()
    with pytest.raises(ValueError):
        TorchRangeBackend.load(path, 4, 9, progress=None)
    with pytest.raises(FileNotFoundError):
        TorchRangeBackend.load(tmp_path, 0, 1, progress=None)

    class Cfg:
        model_type = "mamba"

    with pytest.raises(UnsupportedArchitecture):
        adapter_for(Cfg())


def test_model_families_register_themselves_one_family_per_model_type(monkeypatch):
    # The model room never imports the families that extend it: they register where they are defined.
    import shard.experts.adapters as moe  # importing registers (before the registry is copied below)
    from shard.model import adapters

    assert {moe.Qwen3MoeFamily, moe.Qwen2MoeFamily} <= set(adapters._FAMILIES)
    monkeypatch.setattr(adapters, "_FAMILIES", list(adapters._FAMILIES))   # the registry as it was, after

    @adapters.register_family
    class ToyFamily(adapters.LlamaFamily):
        MODEL_TYPES = {"toy": "Toy"}

        def __init__(self, config) -> None:
            self.config = config

    class Cfg:
        model_type = "toy"

    assert isinstance(adapters.adapter_for(Cfg()), ToyFamily)
    with pytest.raises(ValueError, match="both serve"):
        @adapters.register_family
        class Impostor(adapters.LlamaFamily):
            MODEL_TYPES = {"llama": "Llama"}


@pytest.mark.parametrize("tied", [True, False])
def test_the_lm_head_runs_input_major_with_one_copy_of_a_tied_table(tied):
    """Llama-family tails hold the head as [hidden, vocab] (adapters.InputMajorLinear); a tied table is
    one tensor for the embedding and the head; values and logits are the row-major ones."""
    import torch
    from safetensors.torch import load_file

    from shard.model.adapters import ColumnEmbedding, InputMajorLinear

    path = testmodels.build_random_llama(seed=3, tie_word_embeddings=tied)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    table = tensors["model.embed_tokens.weight"]
    head = table if tied else tensors["lm_head.weight"]
    whole = TorchRangeBackend.load(path, 0, None, progress=None)
    tail = TorchRangeBackend.load(path, 2, None, progress=None)
    for backend in (whole, tail):
        assert isinstance(backend.modules.lm_head, InputMajorLinear)
        assert torch.equal(backend.modules.lm_head.weight_t, head.t())
        assert backend.modules.lm_head.weight_t.is_contiguous()
    ids = torch.tensor([[0, 5, 17, table.shape[0] - 1]])
    assert torch.equal(whole.modules.embed(ids), table[ids])
    if tied:
        assert isinstance(whole.modules.embed, ColumnEmbedding)
        assert whole.modules.embed.weight_t.data_ptr() == whole.modules.lm_head.weight_t.data_ptr()
    else:
        assert isinstance(whole.modules.embed, torch.nn.Embedding)
    rows = torch.randn(1, 3, head.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        diff = float((whole.modules.lm_head(rows) - torch.nn.functional.linear(rows, head)).abs().max())
    print(f"input-major head vs nn.Linear ({tied=}): max diff {diff:.3g}")
    assert diff < 1e-4


@pytest.mark.parametrize("bias", [False, True])
def test_the_layers_dense_projections_run_input_major(bias):
    """Every Llama-family layer's q/k/v/o and gate/up/down projection holds its weight as [in, out]
    (adapters.InputMajorLinear), biases kept; each computes nn.Linear's product; a split run equals
    the transformers reference (which runs the same layout) bit for bit."""
    from safetensors.torch import load_file

    from shard.model.adapters import DENSE_PROJECTIONS, InputMajorLinear

    path = testmodels.build_random_llama(seed=4, attention_bias=bias, mlp_bias=bias)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    middle = TorchRangeBackend.load(path, 2, 5, progress=None)
    checked = 0
    generator = torch.Generator().manual_seed(1)
    for local, layer in enumerate(middle.modules.layers):
        for part, names in DENSE_PROJECTIONS:
            for name in names:
                proj = getattr(getattr(layer, part), name)
                key = f"model.layers.{2 + local}.{part}.{name}"
                weight = tensors[f"{key}.weight"]
                assert isinstance(proj, InputMajorLinear)
                assert proj.weight_t.is_contiguous() and torch.equal(proj.weight_t, weight.t())
                expected_bias = tensors.get(f"{key}.bias")
                assert (expected_bias is not None) == bias
                assert (proj.bias is None) == (not bias)
                if bias:
                    assert torch.equal(proj.bias, expected_bias)
                rows = torch.randn(1, 3, weight.shape[1], generator=generator)
                with torch.inference_mode():
                    diff = float((proj(rows) - torch.nn.functional.linear(rows, weight, expected_bias)).abs().max())
                assert diff < 1e-4
                checked += 1
    assert checked == 3 * 7
    whole = WholeModel(path)
    assert all(isinstance(layer.mlp.down_proj, InputMajorLinear) for layer in whole.model.model.layers)
    ref = whole.generate(PROMPT, 8, chunk_tokens=16)
    parts = [TorchRangeBackend.load(path, a, b, progress=None) for a, b in ((0, 2), (2, 5), (5, 6))]
    tokens, logits = run_split(parts, PROMPT, 8, chunk=16)
    assert tokens == ref.tokens and max_diff(logits, ref.logits) == 0.0
