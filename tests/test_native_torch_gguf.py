"""torch-GGUF (dequantized GGUF ranges in torch) against transformers on the same weights."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from meshd.testing.models import build_random_llama, smollm2_artifact, smollm2_gguf_path
from native.convert import convert
from native.errors import ArtifactError
from native.torch_gguf import load_torch_gguf
from shard.model.backend import LayerRange
from shard.model.reference import WholeModel
from tests._native_helpers import greedy_chain, max_logit_diff, ranges

PROMPT = [5, 17, 99, 200, 3, 44, 12, 8, 150, 77]
SMOL_PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378]


@pytest.fixture(autouse=True)
def _few_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _transformers_from_gguf(path, tmp_path):
    """transformers' own gguf_file= loader over the same file: the independent reference."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "gguf-model"
    folder.mkdir()
    shutil.copy(path, folder / "model.gguf")
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf", dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    whole = WholeModel.__new__(WholeModel)
    whole.model = model
    return whole


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_torch_gguf_matches_transformers_gguf_loader(qtype, tmp_path):
    path = convert(build_random_llama(), qtype, progress=None)
    reference = _transformers_from_gguf(path, tmp_path).generate(PROMPT, 32)
    whole = [load_torch_gguf(path, LayerRange(0, 6, 6), progress=None)]
    split = [load_torch_gguf(path, r, progress=None) for r in ranges([2, 4], 6)]
    got_whole = greedy_chain(whole, PROMPT, 32)
    got_split = greedy_chain(split, PROMPT, 32)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(reference.logits, got_whole.logits))
    print(f"\ntorch-GGUF {qtype} vs transformers gguf_file=: max|dlogit|={diff}; "
          f"split vs whole {max_logit_diff(got_whole, got_split)}")
    assert got_whole.tokens == reference.tokens
    assert got_split.tokens == got_whole.tokens and max_logit_diff(got_whole, got_split) == 0.0


def test_fingerprint_differs_from_llama_and_between_quantizations():
    artifact = build_random_llama()
    f16 = load_torch_gguf(convert(artifact, "F16", progress=None), LayerRange(0, 3, 6), progress=None)
    q8 = load_torch_gguf(convert(artifact, "Q8_0", progress=None), LayerRange(0, 3, 6), progress=None)
    assert f16.fingerprint.runtime_recipe_digest != q8.fingerprint.runtime_recipe_digest
    assert f16.fingerprint.recipe_id.startswith("torch/gguf-llama-F16")
    assert f16.backend_name == "torch"


def test_truncated_and_wrong_range(tmp_path):
    path = convert(build_random_llama(), "F16", progress=None)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ArtifactError):
        load_torch_gguf(cut, LayerRange(0, 6, 6), progress=None)
    from native.errors import RangeUnavailable
    with pytest.raises(RangeUnavailable):
        load_torch_gguf(path, LayerRange(0, 2, 7), progress=None)


@pytest.mark.slow
def test_smollm2_torch_gguf_equals_transformers_dequantized_artifact():
    """The Q4_1 file through our dequantizer == transformers' dequantized safetensors artifact."""
    reference = WholeModel(smollm2_artifact("float32")).generate(SMOL_PROMPT, 32)
    backends = [load_torch_gguf(smollm2_gguf_path(), r, progress=None) for r in ranges([15], 30)]
    got = greedy_chain(backends, SMOL_PROMPT, 32)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(reference.logits, got.logits))
    print(f"\nSmolLM2 torch-GGUF split vs transformers artifact: max|dlogit|={diff}")
    assert got.tokens == reference.tokens
