"""Backend factory hook for the worker: a ``.gguf`` path -> the right RangeBackend.

``load_gguf_backend(path, start, end, backend=..., ...)`` is what
``meshd worker --model FILE.gguf --layers A:B --backend llama.cpp|torch``
calls: ``llama.cpp`` gives a ``LlamaRangeBackend`` (per-range slice run by
llama.cpp), ``torch`` gives shard's ``TorchRangeBackend`` built from the
dequantized GGUF tensors (``torch_gguf``). Both report a fingerprint whose
recipe names the backend and the GGUF quantization, so the session layer
refuses a hop whose fingerprint differs from the route's.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from native.gguf_range import model_info, open_reader
from shard.model.backend import LayerRange

__all__ = ["is_gguf", "load_gguf_backend", "auto_kv_streams", "GGUF_BACKENDS", "AUTO"]

GGUF_BACKENDS = ("llama.cpp", "torch")
# llama.cpp's LLAMA_MAX_SEQ: sequences one context can hold.
MAX_LLAMA_SEQUENCES = 256
# kv_streams="auto" (the default): one KV stream per session, as many streams as the budget gives
# AUTO_STREAM_TOKENS each, at most AUTO_MAX_STREAMS. The shared pool (kv_streams=0) lets a running
# session's greedy tokens drift from the same request alone: llama.cpp refills the cells a released
# session freed from the start of the pool, so the running sessions' next cells lie before their
# earlier ones and flash attention sums them in another order (logits off by ~0.5-1,
# tests/test_batching_native.py). A stream is emptied with its session, so its cells stay in
# position order: bit-exact. 2048 tokens per stream hold a chat with its history (prompt +
# max_tokens; a longer session is refused at once with the stream's size), so the default
# 4096-token budget serves 2 sessions at once; a bigger budget serves more (up to 8, what batching
# on a CPU worker gains from), and ``llama_kv_streams = N`` trades length for concurrency
# (meshd bench serve's c=8 lane: 8 streams of 512 tokens).
AUTO = "auto"
AUTO_STREAM_TOKENS = 2048
AUTO_MAX_STREAMS = 8


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def load_gguf_backend(path: str | Path, start: int, end: int | None, *, backend: str = "llama.cpp",
                      dtype: str = "float32", n_threads: int = 2, kv_budget_tokens: int = 16384,
                      max_sessions: int = 64, kv_streams: int | str = AUTO, progress: TextIO | None = sys.stderr,
                      slice_dir: Path | None = None):
    """Load layers [start, end) (``end`` None = to the last layer) of a GGUF file.

    ``kv_streams`` (llama.cpp): N = N per-session streams of ``kv_budget_tokens // N`` cells
    (kv_unified off, bit-exact under concurrency); ``"auto"`` (default) = ``auto_kv_streams``;
    0 = one KV pool shared by up to ``max_sessions`` sessions (opt-in: not exact under concurrency).
    ``slice_dir`` (llama.cpp): the node's own slice directory (LlamaBackendConfig.slice_dir)."""
    if backend not in GGUF_BACKENDS:
        raise ValueError(f"backend must be one of {GGUF_BACKENDS}, got {backend!r}")
    info = model_info(open_reader(path))
    num_layers = info.num_layers
    layer_range = LayerRange(start, num_layers if end is None else end, num_layers)
    if backend == "torch" and info.architecture == "qwen3moe":
        from native.errors import ArtifactError

        raise ArtifactError("the torch lane over GGUF does not dequantize qwen3moe experts; run it with "
                            "--backend llama.cpp (or its safetensors artifact with the torch lane)")
    if backend == "torch":
        from native.torch_gguf import load_torch_gguf

        return load_torch_gguf(path, layer_range, dtype=dtype, progress=progress)
    if dtype != "float32":
        raise ValueError("llama.cpp computes in float32; its boundary dtype is float32 (omit --dtype)")
    from native.llama_backend import LlamaBackendConfig, LlamaRangeBackend

    if kv_streams == AUTO:
        kv_streams = auto_kv_streams(kv_budget_tokens, max_sessions)
    if isinstance(kv_streams, bool) or not isinstance(kv_streams, int) or not 0 <= kv_streams <= MAX_LLAMA_SEQUENCES:
        raise ValueError(f"kv_streams must be 'auto' or in 0..{MAX_LLAMA_SEQUENCES}, got {kv_streams!r}")
    sessions = kv_streams or min(max_sessions, MAX_LLAMA_SEQUENCES)
    config = LlamaBackendConfig(n_threads=n_threads, kv_budget_tokens=kv_budget_tokens,
                                max_sessions=sessions, kv_unified=not kv_streams, slice_dir=slice_dir)
    return LlamaRangeBackend(path, layer_range, config, progress=progress)


def auto_kv_streams(kv_budget_tokens: int, max_sessions: int) -> int:
    """The default number of per-session KV streams for a budget (see AUTO_STREAM_TOKENS)."""
    return max(1, min(AUTO_MAX_STREAMS, max_sessions, MAX_LLAMA_SEQUENCES, kv_budget_tokens // AUTO_STREAM_TOKENS))
