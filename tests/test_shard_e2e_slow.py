"""Heavy real-process exactness checks (CI runs them with -m slow).

2 and 3 `meshd worker` processes over disjoint ranges reproduce the whole
model in one process: 32 greedy tokens equal, and the largest logit
difference is printed (fp32 and bf16 are expected to be exactly 0 here).
"""
from __future__ import annotations

import pytest
import torch

from shard import testmodels
from shard.procs import spawn_workers
from tests._shard_helpers import check_route_equals_whole

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def _run(path, specs, num_layers, *, dtype="float32", label, prompt=None, chunk=16):
    workers = spawn_workers(path, specs, dtype=dtype, threads=1)
    try:
        kwargs = {"prompt": prompt} if prompt is not None else {}
        return check_route_equals_whole(path, workers, specs, num_layers, dtype=dtype, label=label,
                                        chunk=chunk, **kwargs)
    finally:
        for w in workers:
            w.stop()


def test_random_llama_three_workers_fp32():
    assert _run(testmodels.build_random_llama(), ["0:2", "2:4", "4:6"], 6, label="random llama") == 0.0


def test_random_llama_two_workers_bf16():
    assert _run(testmodels.build_random_llama(), ["0:3", "3:6"], 6, dtype="bfloat16", label="random llama") == 0.0


@pytest.mark.parametrize("specs", [["0:3", "3:6"], ["0:2", "2:5", "5:6"]])
def test_gemma3_split(specs):
    assert _run(testmodels.build_random_gemma3(), specs, 6, label="random gemma3") == 0.0


def _smollm2_prompt(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok("The capital of France is Paris. The capital of Germany is")["input_ids"]


@pytest.mark.parametrize("specs", [["0:15", "15:30"], ["0:10", "10:20", "20:30"]])
def test_smollm2_fp32_split(specs):
    path = testmodels.smollm2_artifact("float32")
    diff = _run(path, specs, 30, label="SmolLM2-135M fp32", prompt=_smollm2_prompt(path), chunk=128)
    assert diff == 0.0
