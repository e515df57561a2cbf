"""``meshd worker`` serving GGUF ranges (llama.cpp and torch) over real gRPC on loopback."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from meshd.errors import HopFailure
from meshd.generate.driver import RouteFailed
from meshd.generate.routes import PeerConnector, discover_fingerprint, fixed_route
from meshd.testing.models import build_random_llama
from meshd.testing.procs import child_env, spawn_worker
from native.convert import convert
from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend
from proto import shard_runtime_pb2 as pb
from shard.model.backend import LayerRange
from tests._native_helpers import greedy_chain
from tests._shard_helpers import drive_fixed

pytestmark = pytest.mark.native

PROMPT = [5, 17, 99, 200, 3, 44, 12, 8, 150, 77]
KV = ["--kv-budget-tokens", "512", "--max-sessions", "4"]


@pytest.fixture(scope="module")
def ggufs():
    artifact = build_random_llama()
    return {q: convert(artifact, q, progress=None) for q in ("F16", "Q8_0")}


def _route(workers, cuts):
    bounds = list(zip([0, *cuts], [*cuts, 6]))
    return fixed_route([(w.endpoint, a, b) for w, (a, b) in zip(workers, bounds)], 6)


def test_llama_cpp_workers_reproduce_the_whole_model(ggufs):
    whole = LlamaRangeBackend(ggufs["F16"], LayerRange(0, 6, 6), LlamaBackendConfig(kv_budget_tokens=256),
                              progress=None)
    try:
        expected = greedy_chain([whole], PROMPT, 32)
    finally:
        whole.close()
    workers = [spawn_worker(ggufs["F16"], layers, extra=["--backend", "llama.cpp", *KV]) for layers in ("0:3", "3:6")]
    try:
        got = drive_fixed(_route(workers, [3]), PROMPT, 32, return_logits=True)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(expected.logits, got.logits))
        print(f"\nllama.cpp 2-worker route vs in-process whole: max|dlogit|={diff}")
        assert got.tokens == expected.tokens and diff == 0.0
        assert "llama.cpp/gguf-llama-F16" in got.fingerprint.recipe_id
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.slow
def test_mixed_fingerprints_are_refused(ggufs):
    # Same layers, different recipe (torch over the same GGUF) or different file (Q8_0).
    head = spawn_worker(ggufs["F16"], "0:3", extra=["--backend", "llama.cpp", *KV])
    torch_tail = spawn_worker(ggufs["F16"], "3:6", threads=1, extra=["--backend", "torch", *KV])
    q8_tail = spawn_worker(ggufs["Q8_0"], "3:6", extra=["--backend", "llama.cpp", *KV])
    try:
        for tail in (torch_tail, q8_tail):
            with pytest.raises(HopFailure) as info:
                discover_fingerprint(PeerConnector(insecure_loopback=True), _route([head, tail], [3]).route)
            assert info.value.code == pb.ERROR_CODE_FINGERPRINT_MISMATCH and info.value.index == 1
        # A driver that insists on the head's fingerprint is refused by the tail itself.
        head_backend = LlamaRangeBackend(ggufs["F16"], LayerRange(0, 3, 6), LlamaBackendConfig(kv_budget_tokens=64),
                                         progress=None)
        fingerprint = head_backend.fingerprint
        head_backend.close()
        with pytest.raises(RouteFailed) as info:
            drive_fixed(_route([head, q8_tail], [3]), PROMPT, 2, fingerprint=fingerprint)
        failure = info.value.__cause__
        assert failure.index == 1 and failure.code == pb.ERROR_CODE_FINGERPRINT_MISMATCH
    finally:
        for worker in (head, torch_tail, q8_tail):
            worker.stop()


@pytest.mark.slow
def test_torch_gguf_worker_route_is_exact(ggufs):
    workers = [spawn_worker(ggufs["F16"], layers, threads=1, extra=["--backend", "torch", *KV])
               for layers in ("0:2", "2:6")]
    try:
        split = drive_fixed(_route(workers, [2]), PROMPT, 16, return_logits=True)
        whole_worker = spawn_worker(ggufs["F16"], "0:6", threads=1, extra=["--backend", "torch", *KV])
        try:
            whole = drive_fixed(_route([whole_worker], []), PROMPT, 16, return_logits=True)
        finally:
            whole_worker.stop()
        assert split.tokens == whole.tokens
        assert max(float(np.abs(a - b).max()) for a, b in zip(split.logits, whole.logits)) == 0.0
    finally:
        for worker in workers:
            worker.stop()


def test_worker_refuses_bad_gguf_arguments(ggufs, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(ggufs["F16"].read_bytes()[:5000])
    cases = [(cut, "0:6", "truncated or corrupt"), (ggufs["F16"], "0:9", "start < end <= num_layers")]
    for model, layers, message in cases:
        proc = subprocess.run([sys.executable, "-m", "meshd", "worker", "--model", str(model), "--layers", layers,
                               "--backend", "llama.cpp"], env=child_env(1), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
