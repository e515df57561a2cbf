"""The four architectures of the llama.cpp lane (llama, qwen2, qwen3, gemma3) split exactly.

llama.cpp (``native`` marker): seeded random GGUFs of each architecture and the
real Gemma-3-270m Q4_K_M, 2 and 3 ranges against the whole model on the same
runtime: tokens equal and logits identical (difference 0). torch lane (default
suite): the dequantized ranges, split against whole. Across the two runtimes
the first step's logits are compared with a tolerance (F16 weights, different
kernels) and the difference is printed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from meshd.testing.gguf_models import ARCHS, build_random_gguf
from meshd.testing.models import gemma3_gguf_path
from native.torch_gguf import load_torch_gguf
from shard.model.backend import LayerRange
from tests._native_helpers import greedy_chain, max_logit_diff, ranges

PROMPT = [5, 17, 99, 200, 3, 44, 12, 8, 150, 77]
N_NEW = 40  # crosses the random gemma3's sliding window of 8 several times


def _llama(path, layer_ranges):
    from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend

    return [LlamaRangeBackend(path, r, LlamaBackendConfig(kv_budget_tokens=256, max_sessions=2), progress=None)
            for r in layer_ranges]


def _run(backends, n=N_NEW):
    try:
        return greedy_chain(backends, PROMPT, n)
    finally:
        for b in backends:
            close = getattr(b, "close", None)
            if close:
                close()


@pytest.mark.native
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_random_architecture_splits_exactly(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_SLICE_CACHE", str(tmp_path))
    path = build_random_gguf(arch)
    whole = _run(_llama(path, ranges([], 6)))
    for cuts in ([3], [1, 5], [2, 4]):
        split = _run(_llama(path, ranges(cuts, 6)))
        diff = max_logit_diff(whole, split)
        print(f"\n{arch} cuts {cuts}: tokens equal={whole.tokens == split.tokens} max|dlogit|={diff}")
        assert split.tokens == whole.tokens and diff == 0.0


@pytest.mark.native
def test_llama_cpp_real_gemma3_splits_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_SLICE_CACHE", str(tmp_path))
    path = gemma3_gguf_path()
    whole = _run(_llama(path, ranges([], 18)), 24)
    for cuts in ([9], [4, 11], [5, 12]):  # cut before, at and after the global layers 5, 11, 17
        split = _run(_llama(path, ranges(cuts, 18)), 24)
        diff = max_logit_diff(whole, split)
        print(f"\ngemma-3-270m Q4_K_M cuts {cuts}: tokens equal={whole.tokens == split.tokens} max|dlogit|={diff}")
        assert split.tokens == whole.tokens and diff == 0.0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_torch_lane_random_architecture_splits_exactly(arch):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        path = build_random_gguf(arch)
        whole = _run([load_torch_gguf(path, LayerRange(0, 6, 6), progress=None)], 16)
        split = _run([load_torch_gguf(path, r, progress=None) for r in ranges([2, 4], 6)], 16)
    finally:
        torch.set_num_threads(threads)
    assert split.tokens == whole.tokens and max_logit_diff(whole, split) == 0.0


@pytest.mark.native
@pytest.mark.parametrize("arch", ARCHS)
def test_torch_and_llama_cpp_agree_on_the_first_logits(arch):
    path = build_random_gguf(arch)
    cpp = _run(_llama(path, ranges([], 6)), 1)
    ref = _run([load_torch_gguf(path, LayerRange(0, 6, 6), progress=None)], 1)
    diff = float(np.abs(cpp.logits[0].ravel() - ref.logits[0].ravel()).max())
    scale = float(np.abs(ref.logits[0]).max())
    print(f"\n{arch}: llama.cpp vs torch first-step max|dlogit|={diff:.5f} (max|logit| {scale:.2f})")
    assert diff < 0.02 * scale + 0.02  # same model: a wrong adapter (e.g. gemma's 1 + w norms) is far off
