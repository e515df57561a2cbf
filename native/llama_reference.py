"""Whole-model llama.cpp in one process: the reference a llama.cpp swarm is measured against.

``reference_generate(path, prompt, max_new_tokens, n_threads=...)`` loads
the GGUF *as it is* (not a meshd slice) into one ``LlamaEngine`` with the
same context settings a worker uses (flash attention on, F16 KV cache,
unified cells), prefills the prompt in chunks of ``chunk_tokens`` (the
route driver's default, so both feed llama.cpp the same batches), then
decodes greedily one token at a time. It returns the tokens, the last
logits of every step, and the prefill and decode timings
(``meshd bench swarm --backend llama.cpp`` divides the swarm's by these;
the whole model gets all the threads the swarm's daemons share).

``python -m native.llama_reference [--tokens N] [--threads T] [FILE.gguf]``
prints one JSON line; CI's native step runs it on SmolLM2 Q4_1 as its
real-forward check of the installed build (a build that executes an
instruction the OS has not enabled dies here with SIGILL, not in a test).

State: none kept; the engine lives for one call.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from native.gguf_range import model_info, open_reader
from native.llama_engine import MAX_BATCH_TOKENS, EngineConfig, LlamaEngine
from proto.limits import DEFAULT_PREFILL_CHUNK_TOKENS

__all__ = ["ReferenceRun", "reference_generate"]


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    tokens: tuple[int, ...]
    prompt_tokens: int
    prefill_s: float             # prompt in, first token's logits out
    decode_s: float              # the remaining max_new_tokens - 1 steps
    n_threads: int
    logits: tuple[np.ndarray, ...] = field(default=(), repr=False)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"tokens": list(self.tokens), "prompt_tokens": self.prompt_tokens, "n_threads": self.n_threads,
                "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2)}


def reference_generate(path: str | Path, prompt: list[int] | tuple[int, ...], max_new_tokens: int, *,
                       n_threads: int = 2, chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
                       stop_ids: frozenset[int] = frozenset(), keep_logits: bool = False,
                       flash_attn: bool = True) -> ReferenceRun:
    """Greedy generation with the whole GGUF in one llama.cpp context (see the module docstring)."""
    if not prompt or max_new_tokens < 1 or not 1 <= chunk_tokens <= MAX_BATCH_TOKENS:
        raise ValueError("need a prompt, max_new_tokens >= 1 and chunk_tokens in 1..MAX_BATCH_TOKENS")
    info = model_info(open_reader(path))
    if min(prompt) < 0 or max(prompt) >= info.vocab_size:
        raise ValueError(f"prompt token ids must lie in 0..{info.vocab_size - 1}")
    n_ctx = max(64, len(prompt) + max_new_tokens + 16)
    config = EngineConfig(n_threads=n_threads, n_ctx=n_ctx, n_seq_max=1, n_batch=MAX_BATCH_TOKENS,
                          flash_attn=flash_attn)
    engine = LlamaEngine(Path(path), config, n_embd=info.hidden_size, n_vocab=info.vocab_size,
                         capture_layer=None)
    try:
        ids = np.asarray(prompt, np.int32)
        t0 = time.perf_counter()
        for first in range(0, len(ids), chunk_tokens):
            logits = engine.decode(0, first, ids[first:first + chunk_tokens], want_hidden=False)
        prefill_s = time.perf_counter() - t0
        tokens, kept = [int(np.argmax(logits))], [logits] if keep_logits else []
        t1 = time.perf_counter()
        while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
            logits = engine.decode(0, len(ids) + len(tokens) - 1, np.asarray(tokens[-1:], np.int32),
                                   want_hidden=False)
            tokens.append(int(np.argmax(logits)))
            if keep_logits:
                kept.append(logits)
        decode_s = time.perf_counter() - t1
    finally:
        engine.close()
    return ReferenceRun(tuple(tokens), len(prompt), prefill_s, decode_s, n_threads, tuple(kept))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m native.llama_reference", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, help="GGUF file (default: the packaged SmolLM2 Q4_1)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.model is None:
        from native.packaged import smollm2_gguf_path

        args.model = smollm2_gguf_path()
    vocab = model_info(open_reader(args.model)).vocab_size
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, vocab, args.prompt_tokens)]
    run = reference_generate(args.model, prompt, args.tokens, n_threads=args.threads)
    from native.llama_engine import runtime_version

    print(json.dumps({"model": args.model.name, "runtime": runtime_version(), **run.as_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
