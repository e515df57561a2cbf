"""The whole model in one bare process: what one machine running it alone needs (``meshd bench pool``).

    python -m meshd.benchmarks.pool_whole llama.cpp FILE.gguf --prompt 1,2,3 [--tokens 32] ...
    python -m meshd.benchmarks.pool_whole torch DIR --prompt 1,2,3 [--tokens 32] ...

No meshd around it: the llama.cpp lane imports llama-cpp-python and numpy
only and drives llama.cpp's C API with the settings a meshd worker gives its
engine (native/llama_engine.py: the context = the KV budget, per-session KV
streams, F16 cache, flash attention, n_batch 512 / n_ubatch 128, the same
threads; the file mapped, its vocabulary declared absent as the workers do,
since token ids go in), the prompt in 128-token chunks then one token a
step; the torch lane runs transformers' CausalLM (shard/model/reference.py,
the exactness reference). It prints one JSON line: the greedy tokens, its
resident set after its imports (``base_bytes``), its high-water mark over the
prompt and the new tokens (``peak_bytes``: VmHWM, reset once the model is
loaded, as a meshd worker's is: what a load maps and drops -- transformers
reads a safetensors file through a map while it copies the tensors out, so
its VmHWM over the load is weights twice -- is page cache the kernel reclaims
under a memory cap, not memory the process needs), the same over its whole
life (``peak_with_load_bytes``), the weight bytes it holds and the decode rate.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

# The settings a meshd worker gives llama.cpp (native/llama_engine.py, native/factory.py).
N_BATCH = 512
N_UBATCH = 128
CHUNK_TOKENS = 128
STREAM_TOKENS = 2048


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _llama(args) -> dict:
    import llama_cpp as ll

    val_str: Any = ll.llama_model_kv_override_value.val_str   # a ctypes field descriptor
    import llama_cpp._logger
    import numpy as np

    llama_cpp._logger.set_verbose(False)
    base = _status()["VmRSS"]
    mparams = ll.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.load_mode = ll.LLAMA_LOAD_MODE_MMAP
    overrides: Any = (ll.llama_model_kv_override * 3)()   # ctypes array: llama_cpp's stubs type it loosely
    overrides[0].key = b"tokenizer.ggml.model"
    overrides[0].tag = ll.LLAMA_KV_OVERRIDE_TYPE_STR
    ctypes.memmove(ctypes.addressof(overrides[0].value) + val_str.offset,
                   b"no_vocab".ljust(128, b"\0"), 128)
    overrides[1].key = f"{args.arch}.vocab_size".encode()
    overrides[1].tag = ll.LLAMA_KV_OVERRIDE_TYPE_INT
    overrides[1].value.val_i64 = args.vocab
    overrides[2].key = b"\0"
    mparams.kv_overrides = overrides
    model = ll.llama_model_load_from_file(str(args.model).encode(), mparams)
    streams = max(1, min(8, args.kv_budget // STREAM_TOKENS))
    cparams = ll.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = args.kv_budget, N_BATCH, N_UBATCH
    cparams.n_seq_max, cparams.kv_unified = streams, False
    cparams.n_threads = cparams.n_threads_batch = args.threads
    cparams.no_perf = True
    cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = ll.llama_init_from_model(model, cparams)
    batch = ll.llama_batch_init(N_BATCH, 0, 1)
    with_load = _status()["VmHWM"]
    _reset_peak()

    def step(ids: list[int], first: int) -> np.ndarray:
        batch.n_tokens = len(ids)
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, first + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(ids) - 1
        if ll.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, len(ids) - 1), shape=(args.vocab,)).copy()

    prompt = args.prompt
    for first in range(0, len(prompt), CHUNK_TOKENS):
        logits = step(prompt[first:first + CHUNK_TOKENS], first)
    tokens = [int(np.argmax(logits))]
    t0 = time.perf_counter()
    while len(tokens) < args.tokens and tokens[-1] not in args.stop:
        logits = step(tokens[-1:], len(prompt) + len(tokens) - 1)
        tokens.append(int(np.argmax(logits)))
    decode_s = time.perf_counter() - t0
    peak = _status()["VmHWM"]
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return {"tokens": tokens, "base_bytes": base, "peak_bytes": peak, "peak_with_load_bytes": max(peak, with_load),
            "weight_bytes": Path(args.model).stat().st_size,
            "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else 0.0}


def _torch(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import transformers.modeling_utils  # noqa: F401 - the imports a load makes, in the base (as a worker's)

    from shard.model.reference import WholeModel

    base = _status()["VmRSS"]
    whole = WholeModel(args.model, "float32")
    with_load = _status()["VmHWM"]
    _reset_peak()
    ref = whole.generate(args.prompt, args.tokens)
    cut = next((i for i, t in enumerate(ref.tokens) if t in args.stop), None)
    tokens = ref.tokens if cut is None else ref.tokens[:cut + 1]
    weights = sum(p.numel() * p.element_size() for p in whole.model.parameters())
    # transformers copies the tensors out of the safetensors map and keeps the map: its pages stay
    # resident, never read again (a cap reclaims them); they are not what the process needs
    stale = _mapped_rss(Path(args.model))
    peak = _status()["VmHWM"] - stale
    rate = (len(ref.tokens) - 1) / ref.decode_s if ref.decode_s else 0.0
    return {"tokens": tokens, "base_bytes": base, "peak_bytes": peak, "peak_with_load_bytes": max(peak, with_load),
            "stale_map_bytes": stale, "weight_bytes": weights, "decode_tokens_per_s": rate}


def _mapped_rss(directory: Path) -> int:
    """Resident bytes of this process's maps of files under ``directory`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
                inside = len(head) >= 6 and head[5].startswith(str(directory.resolve()))
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshd.benchmarks.pool_whole", description=__doc__.splitlines()[0])
    parser.add_argument("lane", choices=("llama.cpp", "torch"))
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt", required=True, type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--stop", default="", type=lambda s: {int(x) for x in s.split(",") if x})
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-budget", type=int, default=4096)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--vocab", type=int, default=0)
    args = parser.parse_args(argv)
    result = _llama(args) if args.lane == "llama.cpp" else _torch(args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
