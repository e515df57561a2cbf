"""The whole-model llama.cpp reference (native/llama_reference.py) against split llama.cpp ranges."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from meshd.testing.gguf_models import build_random_gguf
from meshd.testing.models import smollm2_gguf_path
from meshd.testing.procs import child_env
from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
from native.llama_reference import reference_generate
from tests._native_helpers import greedy_chain, ranges

pytestmark = pytest.mark.native

SMOL_PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378]
SMALL_PROMPT = [5, 17, 99, 200, 3, 44, 12, 8, 150, 77]  # inside the random models' 384-token vocabulary


@pytest.mark.parametrize("model,n_layers,cuts", [("smollm2", 30, [15]), ("qwen3", 6, [2, 4])])
def test_reference_equals_split_ranges(model, n_layers, cuts):
    path = smollm2_gguf_path() if model == "smollm2" else build_random_gguf("qwen3")
    prompt = SMOL_PROMPT if model == "smollm2" else SMALL_PROMPT
    ref = reference_generate(path, prompt, 24, n_threads=2, keep_logits=True)
    backends = [LlamaRangeBackend(path, r, LlamaBackendConfig(kv_budget_tokens=512, max_sessions=2), progress=None)
                for r in ranges(cuts, n_layers)]
    try:
        split = greedy_chain(backends, prompt, 24)
    finally:
        for b in backends:
            b.close()
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ref.logits, split.logits))
    print(f"\n{model}: reference vs split {cuts}: tokens equal={list(ref.tokens) == split.tokens} max|dlogit|={diff}"
          f" prefill {ref.prefill_tokens_per_s:.1f} tok/s decode {ref.decode_tokens_per_s:.1f} tok/s")
    assert list(ref.tokens) == split.tokens and diff == 0.0
    assert ref.prompt_tokens == len(prompt) and ref.prefill_s > 0 and ref.decode_s > 0


def test_reference_stops_at_a_stop_id_and_chunks_the_prompt():
    path = smollm2_gguf_path()
    free = reference_generate(path, SMOL_PROMPT * 30, 6, chunk_tokens=128)   # 300 tokens: 3 chunks
    one = reference_generate(path, SMOL_PROMPT * 30, 6, chunk_tokens=300)
    assert free.tokens == one.tokens  # chunking does not change the greedy tokens here
    stopped = reference_generate(path, SMOL_PROMPT * 30, 6, stop_ids=frozenset({free.tokens[2]}))
    assert stopped.tokens == free.tokens[:3]
    for bad in ([], [49152]):
        with pytest.raises(ValueError):
            reference_generate(path, bad, 4)


def test_module_prints_one_json_line():
    proc = subprocess.run([sys.executable, "-m", "native.llama_reference", "--tokens", "4"], env=child_env(2),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 4 and out["decode_tokens_per_s"] > 0 and out["n_threads"] == 2
