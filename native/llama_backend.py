"""``LlamaRangeBackend``: a layer range of a GGUF file executed by llama.cpp.

Implements ``shard.model.backend.RangeBackend`` / ``BackendCache``, so shard's
session manager, servicer and worker serve it unchanged.

Data flow: ``forward(cache, inputs, effective_start)`` validates the inputs
(they come from a peer), runs them through the range's one ``LlamaEngine``
on the cache's llama.cpp sequence -- a route entering at a later layer
(``effective_start`` > start) enters it there by injection (llama_engine.py),
on the same weights and KV cache -- and returns the boundary residual
(float32, the dtype llama.cpp computes in, so a split reproduces the whole
model bit for bit) or the tail's last-position logits.

What llama.cpp maps: the source file itself when it already is the range
(the whole model served whole, or a ``meshd slice`` of exactly this range),
else the range's slice (native/slice.py). Memory (shard/model/memory.py):
``weight_bytes`` is that file's size (llama.cpp maps it populated),
``kv_bytes_per_token`` the F16 K and V of every layer of the range, and the
KV buffer is resident from the start (``kv_preallocated``: llama.cpp zeroes it
when it creates the context).

Sessions map to llama.cpp sequences: ``new_cache(max_tokens)`` reserves a
free ``seq_id`` and ``max_tokens`` of the shared KV budget (the context's
cells), ``release()`` frees both and drops the sequence's cells. A forward
that raises drops the sequence's cells too and marks the cache broken, so
the session layer's next request is a CACHE_MISS at past_len 0, exactly like
the torch backend. Idempotency/duplicates live in the session layer above.

State owned here: the engine (model + context), the seq-id pool and the
reserved-token ledger, all under one lock.
"""
from __future__ import annotations

import heapq
import math
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from native.errors import KvCellsExhausted, RangeUnavailable, RuntimeUnavailable
from native.gguf_range import GGUFModelInfo, gguf_recipe, held_range, model_digest, model_info, open_reader
from native.llama_engine import MAX_BATCH_TOKENS, EngineConfig, LlamaEngine, load_llama_cpp
from native.slice import FAKE_VOCAB, range_file
from proto import shard_runtime_pb2 as pb
from proto.errors import LimitExceeded, LocalError, ProtocolViolation
from shard.errors import ResourceExhausted
from shard.model.artifact import make_fingerprint
from shard.model.backend import LayerRange, ids_in_range

__all__ = ["LlamaBackendConfig", "LlamaRangeBackend", "LlamaSeqCache", "KvBudgetExhausted"]

# llama.cpp's KV cache type (type_k / type_v default F16, kept by the engine).
KV_CACHE_BYTES = 2


class KvBudgetExhausted(ResourceExhausted):
    """No free llama.cpp sequence or KV room for a new session; retry later or pick another peer."""


@dataclass(frozen=True, slots=True)
class LlamaBackendConfig:
    n_threads: int = 2
    kv_budget_tokens: int = 4096
    max_sessions: int = 8
    flash_attn: bool = True
    skip_vocab_projection: bool = True  # see EngineConfig; False only for measurement
    # One KV pool for all sessions (a session may use the whole budget). False: one stream of
    # kv_budget_tokens // max_sessions cells per session, which keeps a session's logits bit for
    # bit those of the same request alone while others run (measured on SmolLM2: the shared pool
    # differs by up to 1.5 in logits with concurrent sessions, batched or not; tests/test_batching_native.py).
    kv_unified: bool = True
    # A directory of this node's own for the range's slice (``meshd worker --slice-dir``): a new
    # range's slice replaces the node's slices of other ranges there. None: the shared slice cache.
    slice_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.kv_budget_tokens < 16 or not 1 <= self.max_sessions <= 256 or self.n_threads < 1:
            raise ValueError("kv_budget_tokens >= 16, max_sessions in 1..256, n_threads >= 1")


class LlamaSeqCache:
    """One session's llama.cpp sequence: its id, length and reserved KV room."""

    __slots__ = ("past_len", "seq_id", "max_tokens", "_owner", "_engine_start", "broken", "released", "logits_rows")

    def __init__(self, owner: LlamaRangeBackend, seq_id: int, max_tokens: int) -> None:
        self.logits_rows = False   # a tail's verify step: every position's logits (set by the session manager)
        self.past_len = 0
        self.seq_id = seq_id
        self.max_tokens = max_tokens
        self._owner = owner
        self._engine_start: int | None = None
        self.broken = False
        self.released = False

    def release(self) -> None:
        self._owner._release(self)

    def truncate(self, length: int) -> None:
        """Drop every position from ``length`` on (llama.cpp sequence position removal)."""
        if not 0 <= length <= self.past_len or self.released or self.broken:
            raise LocalError(f"cannot truncate {self.past_len} cached positions to {length}")
        if length < self.past_len and self._engine_start is not None:
            self._owner.engine.truncate(self.seq_id, length)
        self.past_len = length


class LlamaRangeBackend:
    """A validated GGUF layer range served by llama.cpp (see module docstring)."""

    backend_name = "llama.cpp"
    boundary_dtype = np.dtype(np.float32)

    def __init__(self, gguf_path: str | Path, layer_range: LayerRange,
                 config: LlamaBackendConfig = LlamaBackendConfig(),
                 progress: TextIO | None = sys.stderr) -> None:
        self.path = Path(gguf_path)
        self.config = config
        self._progress = progress
        llama_cpp = load_llama_cpp()
        reader = open_reader(self.path)
        self.info: GGUFModelInfo = model_info(reader)
        if layer_range.num_layers != self.info.num_layers:
            raise RangeUnavailable(
                f"range {layer_range} names a {layer_range.num_layers}-layer model; "
                f"{self.path.name} has {self.info.num_layers} layers")
        held = held_range(reader, self.info)
        if not held.start <= layer_range.start < layer_range.end <= held.end:
            raise RangeUnavailable(f"{self.path.name} holds layers {held.start}:{held.end} only; "
                                   f"it cannot serve {layer_range}")
        self.layer_range = layer_range
        self.hidden_size = self.info.hidden_size
        self.vocab_size = self.info.vocab_size
        self.recipe = gguf_recipe(backend=self.backend_name, info=self.info, compute_dtype="float32",
                                  libraries=(("llama-cpp-python", llama_cpp.__version__),))
        self.fingerprint: pb.Fingerprint = make_fingerprint(model_digest(self.path, progress, reader), self.recipe)
        self._lock = threading.Lock()
        # The smallest free id first (a heap): live sessions keep consecutive ids, which is what
        # lets per-session KV streams batch them in one ubatch (llama_engine.stream_groups).
        self._free_seqs = list(range(config.max_sessions))
        self._reserved_tokens = 0
        part = layer_range
        # the file itself when it is the range, else the range's slice (written once, replacing the node's others)
        path = range_file(self.path, part, self._progress, directory=config.slice_dir,
                          replace=config.slice_dir is not None)
        vocab = self.vocab_size if (part.is_head or part.is_tail) else FAKE_VOCAB
        engine_config = EngineConfig(n_threads=config.n_threads, n_ctx=config.kv_budget_tokens,
                                     n_seq_max=config.max_sessions, flash_attn=config.flash_attn,
                                     skip_vocab_projection=config.skip_vocab_projection,
                                     kv_unified=config.kv_unified)
        if self._progress is not None:
            print(f"[meshd llama.cpp] loading {path.name}", file=self._progress, flush=True)
        # The source mapped as it is: llama.cpp is told it has no vocabulary (meshd tokenizes), as a
        # slice says itself, so a tokenizer llama.cpp does not know cannot stop the load.
        overrides: dict[str, int | str] | None = (
            {"tokenizer.ggml.model": "no_vocab", f"{self.info.architecture}.vocab_size": vocab}
            if path == self.path else None)
        self.engine = LlamaEngine(path, engine_config, n_embd=self.hidden_size, n_vocab=vocab,
                                  capture_layer=None if part.is_tail else part.count - 1, overrides=overrides)
        self.weight_bytes = path.stat().st_size   # llama.cpp maps it populated: all of it is resident
        self.kv_bytes_per_token = self.info.kv_elements_per_token_layer() * KV_CACHE_BYTES * part.count

    # llama.cpp zeroes its KV buffer when it creates the context: resident from the start.
    kv_preallocated = True

    @property
    def max_session_tokens(self) -> int:
        """KV positions one session may hold: its stream's, or the whole shared pool's."""
        if self.config.kv_unified:
            return self.config.kv_budget_tokens
        return self.config.kv_budget_tokens // self.config.max_sessions

    def _engine(self, effective_start: int) -> LlamaEngine:
        del effective_start   # every entry point runs on the one engine (injection)
        return self.engine

    # -- sessions -----------------------------------------------------------------------
    def new_cache(self, max_tokens: int) -> LlamaSeqCache:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise LocalError(f"max_tokens must be a positive int, got {max_tokens!r}")
        with self._lock:
            if not self._free_seqs:
                raise KvBudgetExhausted(f"all {self.config.max_sessions} llama.cpp sequences are in use")
            per_stream = self.config.kv_budget_tokens // self.config.max_sessions
            if not self.config.kv_unified and max_tokens > per_stream:
                refusal = KvBudgetExhausted(f"{max_tokens} KV tokens requested; one session's stream holds "
                                            f"{per_stream} (kv_budget_tokens / max_sessions)")
                refusal.retryable = False
                raise refusal
            if self._reserved_tokens + max_tokens > self.config.kv_budget_tokens:
                raise KvBudgetExhausted(
                    f"{max_tokens} KV tokens requested, {self.config.kv_budget_tokens - self._reserved_tokens} free")
            self._reserved_tokens += max_tokens
            return LlamaSeqCache(self, heapq.heappop(self._free_seqs), max_tokens)

    def _release(self, cache: LlamaSeqCache) -> None:
        with self._lock:
            if cache.released:
                return  # release is idempotent
            cache.released = True
            used = cache._engine_start is not None
        if used:
            self.engine.forget(cache.seq_id)
        with self._lock:
            self._reserved_tokens -= cache.max_tokens
            heapq.heappush(self._free_seqs, cache.seq_id)

    # -- compute ------------------------------------------------------------------------
    def _check_inputs(self, inputs: np.ndarray, effective_start: int) -> np.ndarray:
        if not isinstance(inputs, np.ndarray):
            raise ProtocolViolation(f"inputs must be a numpy array, got {type(inputs).__name__}")
        if effective_start == 0:
            if inputs.ndim != 1 or inputs.dtype.kind not in "iu":
                raise ProtocolViolation(f"head inputs must be int token ids [T], got {inputs.dtype}{inputs.shape}")
            if not ids_in_range(inputs, self.vocab_size):
                raise ProtocolViolation(f"token id outside 0..{self.vocab_size - 1}")
            return inputs if inputs.dtype == np.int32 else inputs.astype(np.int32)
        if inputs.ndim != 2 or inputs.shape[1] != self.hidden_size or inputs.dtype.kind != "f":
            raise ProtocolViolation(
                f"hidden inputs must be float [T, {self.hidden_size}], got {inputs.dtype}{inputs.shape}")
        hidden = np.asarray(inputs, dtype=np.float32)
        # One reduction instead of isfinite + all (every decode step): a NaN or an infinity makes
        # the sum non-finite; so would finite values summing past float32's range (~3e38), which
        # no activation row comes near.
        if not math.isfinite(hidden.sum()):
            raise ProtocolViolation("hidden state contains NaN or infinity (or overflowing values)")
        return hidden

    def _prepare(self, cache: LlamaSeqCache, inputs: np.ndarray, effective_start: int) -> np.ndarray:
        """The checks of one session's forward; returns the inputs as llama.cpp takes them."""
        if not isinstance(cache, LlamaSeqCache) or cache._owner is not self:
            raise LocalError("cache does not belong to this backend")
        if cache.released or cache.broken:
            raise LocalError("cache was released or broken by an earlier failure")
        if not self.layer_range.start <= effective_start < self.layer_range.end:
            raise RangeUnavailable(f"effective start {effective_start} outside range {self.layer_range}")
        if cache._engine_start not in (None, effective_start):
            raise RangeUnavailable("a session cannot change its effective start")
        data = self._check_inputs(inputs, effective_start)
        count = int(data.shape[0])
        if count < 1:
            raise ProtocolViolation("empty forward (0 positions)")
        if count > MAX_BATCH_TOKENS:
            raise LimitExceeded(f"{count} positions in one forward; the limit is {MAX_BATCH_TOKENS}")
        if cache.past_len + count > cache.max_tokens:
            raise KvBudgetExhausted(
                f"session would hold {cache.past_len + count} tokens, reserved {cache.max_tokens}")
        return data

    def _failed(self, engine: LlamaEngine, caches: list[LlamaSeqCache], exc: Exception) -> Exception:
        for cache in caches:
            cache.broken = True
            engine.forget(cache.seq_id)
        if isinstance(exc, ValueError):
            return ProtocolViolation(str(exc))
        if isinstance(exc, KvCellsExhausted):      # the shared KV cells are full: no room, retry later
            return KvBudgetExhausted(f"{exc}; the session's cells were dropped")
        return exc

    # ``forward(..., lend=True)`` may return the tail's logits as llama.cpp's own buffer, valid until
    # this backend's next forward: shard/session/batching.py asks only when the caller reads them at once.
    lends_outputs = True

    def forward(self, cache: LlamaSeqCache, inputs: np.ndarray, *, effective_start: int,
                lend: bool = False) -> np.ndarray:
        data = self._prepare(cache, inputs, effective_start)
        engine = self._engine(effective_start)
        cache._engine_start = effective_start
        try:
            every = frozenset({0}) if cache.logits_rows and self.layer_range.is_tail else frozenset()
            out = engine.decode_many([(cache.seq_id, cache.past_len, data)], want_hidden=not self.layer_range.is_tail,
                                     lend=lend, inject_layer=effective_start - self.layer_range.start,
                                     every=every)[0]
        except (RuntimeUnavailable, ValueError) as exc:
            mapped = self._failed(engine, [cache], exc)
            if mapped is exc:
                raise
            raise mapped from exc
        cache.past_len += int(data.shape[0])
        return out

    @property
    def session_capacity(self) -> int:
        """Sessions this backend can hold at once (llama.cpp sequences; with kv_unified off, streams)."""
        return self.config.max_sessions

    # The scheduler (shard/session/batching.py) keeps a batch within llama.cpp's n_batch.
    max_batch_tokens = MAX_BATCH_TOKENS

    def forward_batch(self, caches: list[LlamaSeqCache], inputs: list[np.ndarray], *,
                      effective_start: int) -> list:
        """Several sessions' rows in one llama_batch (one seq id each); one result or exception each."""
        results: list = [None] * len(caches)
        live, rows = [], []
        for index, (cache, raw) in enumerate(zip(caches, inputs)):
            try:
                data = self._prepare(cache, raw, effective_start)
            except Exception as exc:  # noqa: BLE001 - that session's refusal; the others run
                results[index] = exc
                continue
            live.append(index)
            rows.append((cache.seq_id, cache.past_len, data))
        if not live:
            return results
        engine = self._engine(effective_start)
        for i in live:
            caches[i]._engine_start = effective_start
        try:
            every = frozenset(j for j, i in enumerate(live) if caches[i].logits_rows) \
                if self.layer_range.is_tail else frozenset()
            outs = engine.decode_many(rows, want_hidden=not self.layer_range.is_tail,
                                      inject_layer=effective_start - self.layer_range.start, every=every)
        except (RuntimeUnavailable, ValueError) as exc:
            failed = [caches[i] for i in live]
            mapped = self._failed(engine, failed, exc)
            for i in live:
                results[i] = mapped
            return results
        for i, (_, _, data), out in zip(live, rows, outs):
            caches[i].past_len += int(data.shape[0])
            results[i] = out
        return results

    def close(self) -> None:
        self.engine.close()
