"""One llama.cpp model + context, driven through llama-cpp-python's low-level API.

Data flow of ``LlamaEngine.decode(seq_id, first_pos, inputs)``:
  token ids (head) or float32 embeddings (other shards) -> ``llama_batch``
  (``token`` or ``embd``) -> ``llama_decode`` -> either the logits row of the
  last position (tail) or the raw residual after the slice's last block.

Entering mid-range (``inject_layer`` k): a route may enter the loaded range
at its local layer k. The rows go in as embeddings at layer 0 *and* are
written over the output of layer k - 1 (``l_out-<k-1>``) by the same eval
callback, once llama.cpp has computed it: layers 0..k-1 run on rows nobody
reads (their KV cells hold values only those layers ever attend to), layers
k.. see exactly the route's rows. So every entry point runs on the one
loaded model and its one KV cache: no second slice, no second copy of any
weight (measured and chosen over a slice per entry point, which cost the
sub-range's weights again, and over routing that never enters mid-range,
which overlapping ranges cannot avoid). The price is compute: a step that
enters at k still runs the k layers before it.

Capturing the residual: llama.cpp names each block's output ``l_out-<il>``.
The context is created with an eval callback (``cb_eval``) that asks the
scheduler to stop at exactly that node, copies it out with
``ggml_backend_tensor_get`` and returns ``False``, which makes
``ggml_backend_sched_compute_splits`` skip the rest of the graph: the output
norm and the vocabulary projection of a non-tail slice are never computed.
Every position is marked as an output so the last block keeps all rows
(llama.cpp drops non-output rows inside the last block). The logits buffer
llama.cpp then fills is garbage and is never read.

The scheduler asks the callback about every node before the target
(hundreds per decode step), so the callback is C (native/csrc/capture.c,
built by native/cbuild.py) writing into a buffer this engine owns; through
ctypes into Python it costs a sizeable share of a hop's step
(docs/measurements/2026-12-02.md).
Without a C compiler the Python callback below does the same (``capture``
says which; ``MESHD_LLAMA_CAPTURE=python`` forces it, for measuring).

Working memory: llama.cpp sizes its compute buffer for ``n_ubatch`` rows;
a larger batch runs as several ubatches through the same buffer. 128 rows
(the driver's prefill chunk, so one chunk is one ubatch as in the whole
model) needs a quarter of what 512 did: 12.75 MiB instead of 51 MiB of
compute buffer for a 1.15 B llama (hidden 2048, ffn 5632), and the worker's
peak over its weights and KV fell from ~86 MB to ~40 MB for a 512-row forward.

State: the model, one context whose KV cells are shared by up to
``n_seq_max`` sequences (``kv_unified``), one reusable batch. One lock
serialises every call: a llama_context is not thread-safe. Sequence ids are
handed out by the caller (llama_backend), which owns the session semantics.
"""
from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from native.errors import KvCellsExhausted, RuntimeUnavailable
from proto.limits import DEFAULT_PREFILL_CHUNK_TOKENS

if TYPE_CHECKING:
    from native.cbuild import CaptureState

__all__ = ["EngineConfig", "LlamaEngine", "load_llama_cpp", "runtime_version", "stream_groups"]

# One prefill chunk is at most this many positions: the driver's chunks are
# 128 tokens by default; 512 bounds the batch buffers.
MAX_BATCH_TOKENS = 512
# Rows llama.cpp computes at once (n_ubatch): the driver's prefill chunk. It sizes the compute
# buffer (the worker's working memory; module docstring); longer batches run as several ubatches.
DEFAULT_UBATCH_TOKENS = DEFAULT_PREFILL_CHUNK_TOKENS
_GGML_TYPE_F32 = 0
_INSTALL_HINT = "install the [native] extra: bash scripts/install-native.sh"


def load_llama_cpp():
    """Import llama_cpp or fail with the install hint."""
    try:
        import llama_cpp
        import llama_cpp._logger as llama_logger
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeUnavailable(f"llama-cpp-python is not installed; {_INSTALL_HINT}") from exc
    llama_logger.set_verbose(False)  # llama.cpp's info chatter off; errors still printed
    return llama_cpp


def runtime_version() -> str:
    llama_cpp = load_llama_cpp()
    return f"llama-cpp-python {llama_cpp.__version__}"


# What a forward without hidden-state inputs offers the injection (nothing: a token batch enters at layer 0).
_NO_ROWS = np.empty(0, dtype=np.float32)

class _Ggml:
    """The four ggml-base functions the eval callback needs (not bound by llama_cpp)."""

    def __init__(self, llama_cpp) -> None:
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
        self.get_name = lib.ggml_get_name
        self.get_name.argtypes, self.get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        self.nbytes = lib.ggml_nbytes
        self.nbytes.argtypes, self.nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
        self.tensor_get = lib.ggml_backend_tensor_get
        self.tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.tensor_get.restype = None
        self.tensor_set = lib.ggml_backend_tensor_set
        self.tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.tensor_set.restype = None

    @staticmethod
    def type_of(tensor: int) -> int:
        # struct ggml_tensor starts with `enum ggml_type type` (ggml.h).
        return ctypes.c_int32.from_address(tensor).value


# llama.cpp's metadata override: a key of at most 127 bytes, a string value of at most 127.
MAX_OVERRIDE_BYTES = 127


def _kv_overrides(ll, overrides: dict[str, int | str]):
    """A sentinel-terminated ``llama_model_kv_override`` array: metadata llama.cpp reads instead of
    the file's (e.g. ``tokenizer.ggml.model = "no_vocab"``: meshd tokenizes, llama.cpp never has to
    understand a vocabulary it may not know)."""
    array = (ll.llama_model_kv_override * (len(overrides) + 1))()
    for item, (key, value) in zip(array, overrides.items()):
        raw = key.encode()
        if len(raw) > MAX_OVERRIDE_BYTES:
            raise ValueError(f"override key {key[:40]!r}... is too long")
        item.key = raw
        if isinstance(value, str):
            text = value.encode()
            if len(text) > MAX_OVERRIDE_BYTES:
                raise ValueError(f"override value for {key} is too long")
            item.tag = ll.LLAMA_KV_OVERRIDE_TYPE_STR
            ctypes.memmove(ctypes.addressof(item.value) + ll.llama_model_kv_override_value.val_str.offset,
                           text.ljust(MAX_OVERRIDE_BYTES + 1, b"\0"), MAX_OVERRIDE_BYTES + 1)
        else:
            item.tag = ll.LLAMA_KV_OVERRIDE_TYPE_INT
            item.value.val_i64 = int(value)
    array[len(overrides)].key = b"\0"
    return array


@dataclass(frozen=True, slots=True)
class EngineConfig:
    n_threads: int = 2
    # KV cells shared by all sessions of this engine (the KV token budget).
    n_ctx: int = 4096
    # Concurrent sessions (llama.cpp sequences) this engine can hold.
    n_seq_max: int = 8
    n_batch: int = MAX_BATCH_TOKENS
    n_ubatch: int = DEFAULT_UBATCH_TOKENS
    # Flash attention on: the faster CPU path, and fixed (not "auto") so a
    # split and a whole model always take the same attention kernel.
    flash_attn: bool = True
    # Stop the graph after the captured block (non-tail). False only to
    # measure what the skipped output norm + vocabulary projection cost.
    skip_vocab_projection: bool = True
    # One KV cell pool shared by every sequence (a session may use the whole budget).
    # False gives each sequence its own stream of n_ctx / n_seq_max cells.
    kv_unified: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.n_threads <= 256:
            raise ValueError("n_threads must be in 1..256")
        if not 1 <= self.n_seq_max <= 256:
            raise ValueError("n_seq_max must be in 1..256 (llama.cpp's LLAMA_MAX_SEQ)")
        if self.n_ctx < 16 or not 1 <= self.n_batch <= MAX_BATCH_TOKENS:
            raise ValueError("n_ctx must be >= 16 and n_batch in 1..MAX_BATCH_TOKENS")
        if not 1 <= self.n_ubatch <= self.n_batch:
            raise ValueError("n_ubatch must be in 1..n_batch")


def stream_groups(rows: list[tuple[int, int, np.ndarray]], max_rows: int = MAX_BATCH_TOKENS) -> list[list[int]]:
    """Indices of ``rows`` in the groups one ``llama_decode`` each may take with per-sequence streams.

    With ``kv_unified`` off llama.cpp cuts a batch into ubatches with ``split_equal(sequential)``:
    a ubatch takes sequences only while their ids follow one another (id, id + 1, ...) in batch
    order, the same number of tokens from each, and lays them out sequence by sequence. A group of
    rows sorted by sequence id, with consecutive ids and equal token counts, and at most
    ``max_rows`` (n_ubatch) rows in all, is therefore one ubatch whose rows come out in the group's
    order -- the captured residual lines up with it, and no prefill chunk is cut into pieces another
    batch's rows would decide (which could change its attention kernel: llama.cpp tiles attention
    from 64 query rows on). Anything else would be cut or reordered, so it becomes groups of its own
    (one sequence alone may exceed ``max_rows``: its ubatches follow one another in order).
    """
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            last = rows[groups[-1][-1]]
            count = rows[i][2].shape[0]
            if (rows[i][0] == last[0] + 1 and count == last[2].shape[0]
                    and count * (len(groups[-1]) + 1) <= max_rows):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


class LlamaEngine:
    """A loaded slice. ``capture_layer`` is the block whose output non-tail calls return;
    ``None`` for a tail slice. ``injectable``: routes may enter at a later layer (module
    docstring); it needs the eval callback, which a tail without it runs without (no per-node
    call on the hot path). With the C callback (native/csrc/capture.c) every engine has it:
    a node it is not asked about costs a string compare."""

    def __init__(self, path: Path, config: EngineConfig, *, n_embd: int, n_vocab: int,
                 capture_layer: int | None, injectable: bool = True,
                 overrides: dict[str, int | str] | None = None) -> None:
        self._ll = load_llama_cpp()
        self._ggml = _Ggml(self._ll)
        self.config = config
        self.n_embd = n_embd
        self.n_vocab = n_vocab
        self.path = Path(path)
        self._target = f"l_out-{capture_layer}".encode() if capture_layer is not None else None
        self.capture = "none" if capture_layer is None else "python"
        self.injectable = injectable
        self._lock = threading.Lock()
        self._want_hidden = False
        self._captured: list[np.ndarray] = []
        self._inject: tuple[bytes, np.ndarray] | None = None   # (node name, rows) during a decode
        self._injected = 0
        ll = self._ll
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        if "load_mode" in {name for name, *_ in type(mparams)._fields_}:
            mparams.load_mode = ll.LLAMA_LOAD_MODE_MMAP   # the weights are the file's page cache, once
        else:  # pragma: no cover - llama-cpp-python before load_mode
            mparams.use_mmap = True
        self._overrides = _kv_overrides(ll, overrides or {})   # kept alive while the model loads
        if overrides:
            mparams.kv_overrides = self._overrides
        self._model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise RuntimeUnavailable(f"llama.cpp could not load {path} (see its log above)")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = config.n_ubatch
        cparams.n_seq_max = config.n_seq_max
        cparams.n_threads = config.n_threads
        cparams.n_threads_batch = config.n_threads
        cparams.kv_unified = config.kv_unified
        cparams.no_perf = True
        cparams.flash_attn_type = (ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn
                                   else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        # Keep a reference: ctypes callbacks die with their Python object.
        self._callback = None
        self._cstate: CaptureState | None = None
        if capture_layer is not None or injectable:
            self._setup_capture(cparams)
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            ll.llama_model_free(self._model)
            raise RuntimeUnavailable(f"llama.cpp could not create a context for {path}")
        self._memory = ll.llama_get_memory(self._ctx)
        self._tok_batch = ll.llama_batch_init(config.n_batch, 0, 1)
        self._emb_batch = ll.llama_batch_init(config.n_batch, n_embd, 1)
        self._closed = False

    def _setup_capture(self, cparams) -> None:
        ll = self._ll
        from native.cbuild import CaptureState, capture_library

        lib = capture_library() if os.environ.get("MESHD_LLAMA_CAPTURE", "c") != "python" else None
        if lib is None:
            self._callback = ll.ggml_backend_sched_eval_callback(self._on_eval)
            cparams.cb_eval = self._callback
            cparams.cb_eval_user_data = None
            return
        self._rows = np.empty(self.config.n_batch * self.n_embd, np.float32)
        state = CaptureState(target=self._target or b"", want=0, stop=int(self.config.skip_vocab_projection),
                             out=self._rows.ctypes.data, cap=self._rows.size, got=0)
        self._cstate = state
        self._callback = ll.ggml_backend_sched_eval_callback(
            ctypes.cast(lib.meshd_capture_eval, ctypes.c_void_p).value)
        cparams.cb_eval = self._callback
        cparams.cb_eval_user_data = ctypes.addressof(state)
        if self._target is not None:
            self.capture = "c"

    # -- eval callback (runs on llama.cpp's thread, inside llama_decode) ----------------
    def _on_eval(self, tensor: int, ask: bool, _user: int) -> bool:
        if self._inject is not None and self._injected >= 0 and self._ggml.get_name(tensor) == self._inject[0]:
            if ask:
                return True
            rows = self._inject[1]
            nbytes = self._ggml.nbytes(tensor)
            if self._ggml.type_of(tensor) != _GGML_TYPE_F32 or self._injected + nbytes > rows.nbytes:
                self._injected = -1
                return False
            self._ggml.tensor_set(tensor, rows.ctypes.data + self._injected, 0, nbytes)
            self._injected += nbytes
            return True
        if not self._want_hidden:
            return not ask  # observe nothing, never stop
        if self._ggml.get_name(tensor) != self._target:
            return not ask
        if ask:
            return True
        if self._ggml.type_of(tensor) != _GGML_TYPE_F32:  # pragma: no cover - llama.cpp invariant
            self._captured.append(np.empty((0, self.n_embd), np.float32))
            return False
        nbytes = self._ggml.nbytes(tensor)
        out = np.empty(nbytes // 4, np.float32)
        self._ggml.tensor_get(tensor, out.ctypes.data, 0, nbytes)
        self._captured.append(out.reshape(-1, self.n_embd))
        return not self.config.skip_vocab_projection  # False: stop, skip norm + vocab projection

    # -- public API ---------------------------------------------------------------------
    def decode(self, seq_id: int, first_pos: int, inputs: np.ndarray, *, want_hidden: bool,
               lend: bool = False, inject_layer: int = 0) -> np.ndarray:
        """Run T positions of sequence ``seq_id`` starting at ``first_pos``.

        ``inputs``: int token ids [T] or float32 embeddings [T, n_embd].
        Returns the residual [T, n_embd] (``want_hidden``) or the last logits [n_vocab].
        ``lend``: the logits are llama.cpp's own buffer, valid until this engine's next decode
        (no copy: the caller reads them at once, e.g. to draw a token).
        ``inject_layer`` k > 0: the embeddings enter at local layer k (module docstring).
        Raises KvCellsExhausted when llama.cpp has no KV cells left for the batch,
        RuntimeUnavailable when it refuses the batch otherwise.
        """
        return self.decode_many([(seq_id, first_pos, inputs)], want_hidden=want_hidden, lend=lend,
                                inject_layer=inject_layer)[0]

    def decode_many(self, rows: list[tuple[int, int, np.ndarray]], *, want_hidden: bool,
                    lend: bool = False, inject_layer: int = 0,
                    every: frozenset[int] = frozenset()) -> list[np.ndarray]:
        """One ``llama_decode`` over several sequences: ``rows`` = [(seq_id, first_pos, inputs)].

        All inputs are token ids, or all embeddings (one batch has one effective start:
        ``inject_layer``, 0 for the range's own first layer).
        Returns, per row, the residual [T, n_embd] (``want_hidden``) or its last logits [n_vocab].
        Errors as ``decode``; a failure leaves every row's sequence in an unknown state.
        With per-sequence KV streams (``kv_unified`` off) the rows run as ``stream_groups``.
        ``lend``: logits as llama.cpp's own buffer (see ``decode``; one llama_decode only).
        ``every``: indices of rows that get the logits of every position, [T, n_vocab] (a verify
        step of speculative decoding), not only the last.
        """
        counts = [int(inputs.shape[0]) for _, _, inputs in rows]
        n = sum(counts)
        if want_hidden and self._target is None:
            raise ValueError("this engine was loaded as a tail: it returns logits, not hidden states")
        if not rows or not 1 <= n <= self.config.n_batch or min(counts) < 1:
            raise ValueError(f"batch of {n} positions outside 1..{self.config.n_batch}")
        if len({seq for seq, _, _ in rows}) != len(rows):
            raise ValueError("one batch holds each sequence at most once")
        if inject_layer:
            if not self.injectable or self._callback is None:
                raise ValueError("this engine was loaded without injection: it cannot take rows mid-range")
            if any(r[2].ndim != 2 for r in rows):
                raise ValueError("rows entering mid-range must be embeddings [T, n_embd]")
        if not self.config.kv_unified and len(rows) > 1:
            # Per-sequence streams: one llama_decode per group llama.cpp keeps whole and in order.
            out: list = [None] * len(rows)
            for group in stream_groups(rows, self.config.n_ubatch):
                results = self._decode_rows([rows[i] for i in group], want_hidden, inject_layer=inject_layer,
                                            every=frozenset(j for j, i in enumerate(group) if i in every))
                for index, result in zip(group, results):
                    out[index] = result
            return out
        return self._decode_rows(rows, want_hidden, lend=lend, inject_layer=inject_layer, every=every)

    def _decode_rows(self, rows: list[tuple[int, int, np.ndarray]], want_hidden: bool,
                     lend: bool = False, inject_layer: int = 0,
                     every: frozenset[int] = frozenset()) -> list[np.ndarray]:
        """One ``llama_decode`` over ``rows`` (checked by decode_many); results in ``rows`` order."""
        counts = [int(inputs.shape[0]) for _, _, inputs in rows]
        n = sum(counts)
        ll = self._ll
        with self._lock:
            if self._closed:
                raise RuntimeUnavailable("llama.cpp engine is closed")
            first_inputs = rows[0][2]
            tokens = first_inputs.ndim == 1
            batch = self._tok_batch if tokens else self._emb_batch
            emb = None
            # One row (every lone decode step) goes in without numpy's concatenation: numpy calls
            # are dear here, each one cold after the previous llama_decode swept the caches.
            if tokens and n == 1:
                batch.token[0] = int(first_inputs[0])
            elif tokens:
                ids = np.ascontiguousarray(np.concatenate([r[2] for r in rows]) if len(rows) > 1 else first_inputs,
                                           dtype=np.int32)
                ctypes.memmove(batch.token, ids.ctypes.data, ids.nbytes)
            else:
                emb = np.ascontiguousarray(np.concatenate([r[2] for r in rows]) if len(rows) > 1 else first_inputs,
                                           dtype=np.float32)
                ctypes.memmove(batch.embd, emb.ctypes.data, emb.nbytes)
            batch.n_tokens = n
            last: list[int] = []
            i = 0
            for row, ((seq_id, first_pos, _), count) in enumerate(zip(rows, counts)):
                all_rows = row in every
                for j in range(count):
                    batch.pos[i] = first_pos + j
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq_id
                    batch.logits[i] = 1 if (want_hidden or all_rows or j == count - 1) else 0
                    i += 1
                last.append(i - 1)
            state = self._cstate
            inject = f"l_out-{inject_layer - 1}".encode() if inject_layer else b""
            entering = emb if emb is not None else _NO_ROWS   # rows entering mid-range are hidden states
            if state is not None:
                state.want, state.got = int(want_hidden), 0
                state.inject, state.in_, state.in_len, state.used = (
                    inject, entering.ctypes.data if inject else None, entering.size if inject else 0, 0)
            self._want_hidden = want_hidden
            self._captured = []
            self._inject, self._injected = ((inject, entering) if inject else None), 0
            try:
                rc = ll.llama_decode(self._ctx, batch)
            finally:
                self._want_hidden = False
                injected = (state.used * 4 if state is not None else self._injected) if inject else 0
                self._inject = None
                if state is not None:
                    state.want, state.in_, state.in_len = 0, None, 0
            if rc == 1:
                raise KvCellsExhausted(f"llama_decode found no free KV cells for {n} positions")
            if rc != 0 and not (inject and injected < 0):
                raise RuntimeUnavailable(f"llama_decode failed with code {rc}")
            if inject and injected != entering.nbytes:
                raise RuntimeUnavailable(f"llama.cpp did not take the rows entering at layer {inject_layer}")
            if want_hidden:
                if state is not None:   # the C capture wrote into this engine's buffer: copy out
                    hidden = (self._rows[:state.got].reshape(n, self.n_embd).copy()
                              if state.got == n * self.n_embd else None)
                else:
                    hidden = np.concatenate(self._captured) if self._captured else None
                if hidden is None or hidden.shape != (n, self.n_embd):
                    raise RuntimeUnavailable("llama.cpp did not expose the last block's output")
                if len(rows) == 1:
                    return [hidden]
                bounds = np.cumsum([0, *counts])
                return [hidden[bounds[k]:bounds[k + 1]] for k in range(len(rows))]
            out = []
            for row, (index, count) in enumerate(zip(last, counts)):
                if row in every:
                    out.append(np.stack([self._logits_at(i) for i in range(index - count + 1, index + 1)]))
                    continue
                view = self._logits_at(index)
                out.append(view if lend else view.copy())
            return out

    def _logits_at(self, index: int) -> np.ndarray:
        """The logits row of batch position ``index`` as llama.cpp's own buffer (lock held)."""
        logits = self._ll.llama_get_logits_ith(self._ctx, index)
        if not logits:
            raise RuntimeUnavailable("llama.cpp returned no logits")
        return np.ctypeslib.as_array(logits, shape=(self.n_vocab,))

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop the KV cells of ``seq_id`` from position ``length`` on (a verify step's rejected drafts)."""
        with self._lock:
            if self._closed:
                raise RuntimeUnavailable("llama.cpp engine is closed")
            if not self._ll.llama_memory_seq_rm(self._memory, seq_id, length, -1):
                raise RuntimeUnavailable(f"llama.cpp could not drop sequence {seq_id}'s positions from {length}")

    def forget(self, seq_id: int) -> None:
        """Drop every KV cell of ``seq_id`` (release, or a failed forward)."""
        with self._lock:
            if not self._closed:
                self._ll.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ll = self._ll
            ll.llama_batch_free(self._tok_batch)
            ll.llama_batch_free(self._emb_batch)
            ll.llama_free(self._ctx)
            ll.llama_model_free(self._model)
