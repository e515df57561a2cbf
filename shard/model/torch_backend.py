"""The torch/transformers RangeBackend: exact execution of one layer range.

Loading (``TorchRangeBackend.load``): read ``config.json``, pick the family
adapter (``shard/model/adapters.py``), build the range's modules on the meta device
with local layer indices, then read only the range's tensors out of the
safetensors files into memory they own (``tensor_file.TensorFile``: pread, no
map of the file left behind, each tensor's page cache handed back) and assign
them (cast to the compute dtype). Nothing outside the range is ever
materialised, so resident memory scales with the range: after the load it is
the weights the modules hold, once.

State: the backend holds the weights (read-only after load). Each session's
``TorchCache`` holds a transformers ``DynamicCache`` over the layers it runs,
created on the first forward for that session's ``effective_start``
(overlapping routes may skip the first owned layers).

Load errors: a directory that is not an artifact is FileNotFoundError; a
config.json transformers cannot read, a safetensors file that does not parse,
or tensors whose shapes disagree with the config are ``ArtifactError`` (one
line that names the file and says what to do).

Boundary tensors cross as numpy: int64 token ids at the head, hidden states in
the compute dtype (float32 or ml_dtypes.bfloat16) elsewhere, float32 logits of
the last position at the tail.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import ml_dtypes
import numpy as np
import torch

from proto import shard_runtime_pb2 as pb
from shard.errors import ArtifactError
from shard.model.adapters import RangeModules, adapter_for, range_config
from shard.model.artifact import make_fingerprint, torch_recipe
from shard.model.backend import LayerRange, ids_in_range
from shard.model.st_manifest import model_root

if TYPE_CHECKING:
    from transformers import DynamicCache

DTYPES = {"float32": (torch.float32, np.dtype(np.float32)), "bfloat16": (torch.bfloat16, np.dtype(ml_dtypes.bfloat16))}


class BackendInputError(ValueError):
    """Inputs that violate the forward contract (shape, dtype, range, capacity)."""


class TorchCache:
    """One session's KV for the layers [effective_start, end) of a range."""

    __slots__ = ("past_len", "max_tokens", "effective_start", "dynamic", "hidden_out", "logits_rows")

    def __init__(self, max_tokens: int) -> None:
        self.hidden_out = False   # a tail's session for embeddings: normed rows, not logits (TailOptions.return_hidden)
        # A tail's verify step (speculative decoding): the logits of every position, [T, vocab]; the
        # session manager sets it for that one forward.
        self.logits_rows = False
        self.past_len = 0
        self.max_tokens = max_tokens
        self.effective_start: int | None = None
        self.dynamic: DynamicCache | None = None

    def release(self) -> None:
        self.dynamic = None
        self.effective_start = None

    def truncate(self, length: int) -> None:
        """Drop every position from ``length`` on (rejected drafts): the KV of the first ``length``
        positions is untouched, so the next forward continues exactly as if they had been the last."""
        if not 0 <= length <= self.past_len:
            raise BackendInputError(f"cannot truncate {self.past_len} cached positions to {length}")
        if length < self.past_len and self.dynamic is not None:
            self.dynamic.crop(length - self.past_len)   # transformers: a negative count removes positions
        self.past_len = length


def _to_torch(array: np.ndarray) -> torch.Tensor:
    if not array.flags.writeable:  # zero-copy wire views are read-only; torch wants writable memory
        array = array.copy()
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.contiguous().numpy()


class TorchRangeBackend:
    """A loaded layer range; see the module docstring. Build with ``load``."""

    backend_name = "torch"

    def __init__(self, *, config, adapter, modules: RangeModules, layer_range: LayerRange,
                 dtype: str, fingerprint: pb.Fingerprint, model_path: Path) -> None:
        self.config = config
        self.adapter = adapter
        self.modules = modules
        self.layer_range = layer_range
        self.dtype_name = dtype
        self.torch_dtype, self.boundary_dtype = DTYPES[dtype]
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.fingerprint = fingerprint
        self.model_path = model_path
        self.sub_config = range_config(config, layer_range)
        self.exchange = None   # MoE: the ExpertExchange the range's delegated experts run on

    # -- loading ---------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, start: int, end: int | None = None, *, dtype: str = "float32",
             progress: TextIO | None = sys.stderr, experts=None, exchange=None) -> TorchRangeBackend:
        """``experts`` (shard.experts.spec.ExpertSpec) / ``exchange`` (shard.experts.dispatch.ExpertExchange):
        MoE families only -- the experts this range loads, and where the others run."""
        from transformers import AutoConfig

        from shard.model.tensor_file import TensorFile

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        model_path = Path(path)
        files = sorted(model_path.glob("*.safetensors"))
        if not (model_path / "config.json").is_file() or not files:
            raise FileNotFoundError(f"{model_path} is not a model artifact (config.json + *.safetensors)")
        try:
            config = AutoConfig.from_pretrained(model_path)
        except Exception as exc:  # not JSON, no model_type, an unknown one, a field of the wrong type
            raise ArtifactError(f"{model_path / 'config.json'} cannot be read: {_one_line(exc)}") from exc
        config = config.get_text_config(decoder=True)
        adapter = adapter_for(config)
        layer_range = LayerRange(start, config.num_hidden_layers if end is None else end, config.num_hidden_layers)
        if experts is not None or exchange is not None:
            if not hasattr(adapter, "configure_experts"):
                raise ValueError(f"{config.model_type} has no experts: --experts applies to MoE models only")
            adapter.configure_experts(experts, exchange)
        torch_dtype = DTYPES[dtype][0]
        t0 = time.monotonic()

        def say(msg: str) -> None:
            if progress is not None:
                print(f"[shard load {layer_range}] {msg}", file=progress, flush=True)

        say(f"{adapter.adapter_name}: building layers {layer_range.start}..{layer_range.end - 1} on meta")
        sub = range_config(config, layer_range)
        modules = adapter.build(sub, layer_range)
        state: dict[str, torch.Tensor] = {}
        expected = {k for k in modules.state_dict().keys()}
        loaded_layers: set[str] = set()
        for file in files:
            try:
                handle = TensorFile(file)   # owned tensors, no map of the file (tensor_file.py)
            except Exception as exc:  # SafetensorError (header, truncation), OSError
                raise ArtifactError(f"{file} is not a readable safetensors file ({_one_line(exc)}); "
                                    "re-create or re-download it") from exc
            with handle as fh:
                for key in fh.keys():
                    targets = adapter.local_names(key, layer_range)
                    if not targets:
                        continue
                    try:
                        tensor = fh.get_tensor(key).to(torch_dtype)
                    except Exception as exc:  # a truncated body reads past the end
                        raise ArtifactError(f"{file}: tensor {key} cannot be read ({_one_line(exc)}); "
                                            "re-create or re-download it") from exc
                    for target in targets:
                        state[target] = tensor
                        if target.startswith("layers."):
                            layer = target.split(".")[1]
                            if layer not in loaded_layers:
                                loaded_layers.add(layer)
                                say(f"read layer {layer_range.start + int(layer)} "
                                    f"({len(loaded_layers)}/{layer_range.count})")
        state = adapter.finish_state(state, layer_range)
        missing = expected - state.keys()
        if missing:
            raise FileNotFoundError(f"{model_path} lacks tensors for this range: {sorted(missing)[:5]}")
        try:
            modules.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:  # size mismatch: the tensors are not the model config.json describes
            raise ArtifactError(f"{model_path}: tensors do not match config.json ({_one_line(exc)[:300]})") from exc
        state.clear()   # the modules hold the tensors now: each layout swap frees what it copies
        adapter.finish_modules(modules)
        modules.eval().requires_grad_(False)
        leftover = [n for n, t in [*modules.named_parameters(), *modules.named_buffers()] if t.is_meta]
        if leftover:
            raise RuntimeError(f"tensors left on the meta device: {leftover[:5]}")
        say("the model's root for its fingerprint (cached per file)")
        fingerprint = make_fingerprint(model_root(model_path),
                                       torch_recipe(dtype, adapter.adapter_name))
        backend = cls(config=config, adapter=adapter, modules=modules, layer_range=layer_range,
                      dtype=dtype, fingerprint=fingerprint, model_path=model_path)
        backend.exchange = exchange
        say(f"loaded {backend.weight_bytes / 1e6:.1f} MB of weights in {time.monotonic() - t0:.1f}s")
        return backend

    @property
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for t in [*self.modules.parameters(), *self.modules.buffers()]:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total

    # A session's KV grows with its positions (transformers' DynamicCache): none is resident before.
    kv_preallocated = False

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position over the range's layers, in the compute dtype (shard/model/memory.py)."""
        cfg = self.config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        width = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * heads * head_dim * width * self.layer_range.count

    # -- execution -----------------------------------------------------------------
    def new_cache(self, max_tokens: int) -> TorchCache:
        if max_tokens <= 0:
            raise BackendInputError(f"max_tokens must be positive, got {max_tokens}")
        return TorchCache(max_tokens)

    def _check(self, cache: TorchCache, inputs: np.ndarray, effective_start: int) -> int:
        lr = self.layer_range
        if not lr.start <= effective_start < lr.end:
            raise BackendInputError(f"effective_start {effective_start} outside {lr}")
        if cache.effective_start is not None and cache.effective_start != effective_start:
            raise BackendInputError("effective_start changed within one session cache")
        if effective_start == 0:
            if inputs.dtype != np.int64 or inputs.ndim != 1:
                raise BackendInputError(f"head input must be int64 [T], got {inputs.dtype} {inputs.shape}")
            if not ids_in_range(inputs, self.vocab_size):
                raise BackendInputError(f"token id outside 0..{self.vocab_size - 1}")
        elif inputs.dtype != self.boundary_dtype or inputs.ndim != 2 or inputs.shape[1] != self.hidden_size:
            raise BackendInputError(
                f"hidden input must be {self.boundary_dtype} [T, {self.hidden_size}],"
                f" got {inputs.dtype} {inputs.shape}")
        count = inputs.shape[0]
        if count == 0:
            raise BackendInputError("empty input")
        if cache.past_len + count > cache.max_tokens:
            raise BackendInputError(
                f"cache holds {cache.past_len} of {cache.max_tokens} tokens; {count} more do not fit")
        return count

    def forward(self, cache: TorchCache, inputs: np.ndarray, *, effective_start: int) -> np.ndarray:
        from transformers import DynamicCache

        count = self._check(cache, inputs, effective_start)
        sub, modules = self.sub_config, self.modules
        if cache.dynamic is None:
            if cache.past_len:
                raise BackendInputError("cache was released")
            # Over all owned layers (local indices); skipped ones stay empty.
            cache.dynamic = DynamicCache(config=sub)
            cache.effective_start = effective_start
        with torch.inference_mode():
            x = _to_torch(inputs).unsqueeze(0)
            hidden = self.adapter.embed(modules, x) if effective_start == 0 else x
            position_ids = (torch.arange(count) + cache.past_len).unsqueeze(0)
            hidden = self.adapter.run_layers(sub, modules, hidden, cache.dynamic, position_ids,
                                             skip=effective_start - self.layer_range.start)
            cache.past_len += count
            if self.exchange is not None:
                self.exchange.note_positions(count)
            if self.layer_range.is_tail and cache.hidden_out:
                return modules.norm(hidden)[0].float().numpy()
            if self.layer_range.is_tail and cache.logits_rows:
                return self.adapter.logits(modules, hidden, every=True)[0].float().numpy()
            if self.layer_range.is_tail:
                return self.adapter.logits(modules, hidden)[0, -1].float().numpy()
            return _to_numpy(hidden[0])

    def forward_batch(self, caches: list[TorchCache], inputs: list[np.ndarray], *,
                      effective_start: int) -> list[np.ndarray | Exception]:
        """Several sessions' rows in one forward (shard/model/torch_batch.py); one result or exception each."""
        from shard.model.torch_batch import forward_rows, supports_batch

        if not supports_batch(self):
            results: list[np.ndarray | Exception] = []
            for cache, rows in zip(caches, inputs):
                try:
                    results.append(self.forward(cache, rows, effective_start=effective_start))
                except Exception as exc:  # noqa: BLE001 - that session's failure only
                    results.append(exc)
            return results
        return forward_rows(self, caches, inputs, effective_start, _to_torch, _to_numpy)
