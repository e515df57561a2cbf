"""A draft model at the entry: a small GGUF run by llama.cpp guesses the next tokens (speculative decoding).

``LlamaDrafter(path).draft(history, k)`` returns the draft model's greedy
continuation of ``history``, at most k tokens: the ``Drafter`` shape the
speculative driver takes (meshd/generate/draft.py; native/ cannot import
meshd/, so the match is structural). The draft model must share the target's
tokenizer -- the Q4 GGUF of the same model when the swarm serves F16, or a
smaller model of the family; a token id past the target's vocabulary would be
refused by the route's head, so ``vocab_size`` is there to be checked.

State: one llama.cpp context with one sequence, and the tokens whose KV it
holds (``_fed``). A call keeps the longest common prefix of ``_fed`` and the
history, drops the rest of the sequence (sequence position removal: rejected
drafts, or another generation's text), feeds the new history tokens in
chunks, then decodes k - 1 more tokens one at a time. Each call thus costs
the tokens that changed plus k one-row steps: the draft model's per-token
compute, small next to the round trips it saves on a WAN route.

Threads: calls are serialized by the engine's lock; a drafter serves one
generation at a time (the driver's thread). ``close`` frees the context.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from native.gguf_range import model_info, open_reader
from native.llama_engine import MAX_BATCH_TOKENS, EngineConfig, LlamaEngine
from proto.limits import MAX_DRAFT_TOKENS

# Positions the draft model's context holds: history plus drafts beyond it get no guess
# (the generation goes on with plain steps); 4096 covers the prompts the API admits by default.
DEFAULT_DRAFT_CONTEXT = 4096
# Threads the draft model computes with: it runs between the route's steps, on the entry's cores.
DEFAULT_DRAFT_THREADS = 2


class LlamaDrafter:
    """Greedy drafts from a local GGUF (module doc)."""

    def __init__(self, path: str | Path, *, n_ctx: int = DEFAULT_DRAFT_CONTEXT,
                 n_threads: int = DEFAULT_DRAFT_THREADS) -> None:
        self.path = Path(path)
        info = model_info(open_reader(self.path))
        self.vocab_size = info.vocab_size
        self.n_ctx = n_ctx
        self.name = f"draft-model:{self.path.name}"
        self._engine = LlamaEngine(self.path, EngineConfig(n_threads=n_threads, n_ctx=n_ctx, n_seq_max=1,
                                                           n_batch=MAX_BATCH_TOKENS),
                                   n_embd=info.hidden_size, n_vocab=info.vocab_size, capture_layer=None)
        self._fed: list[int] = []

    def draft(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        if not 0 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"k must be in 0..{MAX_DRAFT_TOKENS}")
        if k == 0 or not history or len(history) + k > self.n_ctx:
            return ()
        if max(history) >= self.vocab_size:
            return ()       # text the draft model cannot read: another tokenizer
        logits = self._feed(history)
        drafts = [int(np.argmax(logits))]
        while len(drafts) < k:
            logits = self._engine.decode(0, len(self._fed), np.asarray(drafts[-1:], np.int32), want_hidden=False,
                                         lend=True)
            self._fed.append(drafts[-1])
            drafts.append(int(np.argmax(logits)))
        return tuple(drafts)

    def prepare(self, history: Sequence[int]) -> None:
        """Feed ``history`` ahead of the first draft (the entry does it while the route runs the
        prompt, so the first verify step does not pay the draft model's prefill)."""
        if history and len(history) < self.n_ctx and max(history) < self.vocab_size:
            self._feed(history)

    def _feed(self, history: Sequence[int]) -> np.ndarray:
        """Sync the sequence with ``history`` (module doc); the last position's logits (lent)."""
        keep = 0
        limit = min(len(self._fed), len(history) - 1)   # the last token is always fed: its logits are the guess
        while keep < limit and self._fed[keep] == history[keep]:
            keep += 1
        engine = self._engine
        if keep < len(self._fed):
            engine.truncate(0, keep)
            del self._fed[keep:]
        ids = np.asarray(history[keep:], np.int32)
        for first in range(0, ids.size, MAX_BATCH_TOKENS):
            logits = engine.decode(0, keep + first, ids[first:first + MAX_BATCH_TOKENS], want_hidden=False, lend=True)
        self._fed.extend(int(t) for t in ids)
        return logits

    def close(self) -> None:
        self._engine.close()
