"""An expert peer's weights: some experts of some MoE layers, loaded without their layers.

``ExpertStore.load(path, spec, dtype=...)`` reads ``config.json``, checks the
spec against the model (sparse layers only, expert ids in range, a shared
expert only where the family has one), and streams out of the safetensors
files exactly the tensors of the held experts (one key per expert and
projection; a fused checkpoint is sliced). Nothing else of the model is
read: not the attention, not the router, not the embeddings.

``compute(layer, expert, rows)`` runs one expert on float32 rows [n, hidden]
with the same ops the holder would run (shard/experts/dispatch.py ``expert_ffn``; the
shared expert through transformers' own ``Qwen2MoeMLP``), in the recipe's
dtype, and returns the unweighted output as float32 [n, hidden].

Bit-exactness needs the weights laid out in memory as the holder lays them
out, not only equal: a one-row product (decode) takes a different kernel
path for a weight 64-byte aligned than for one at another offset (a last-bit
difference: docs/measurements/2026-12-01.md). So the held experts of a layer are stacked into one
fresh tensor, like the holder's (and transformers') fused experts -- expert
i at offset i x its size, aligned whenever a projection is a multiple of 16
floats, as in every real model --, and the shared expert is kept exactly as
read from the file, as the holder keeps it.

``validate()`` is the bounded real forward an expert placement is
published after: every held expert on ``VALIDATION_ROWS`` seeded random
rows, outputs checked for shape and finiteness, timed.

State: read-only weights after load; no per-session state at all (experts
keep no KV), which is why an expert peer can fail over mid-step.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers.activations import ACT2FN

from shard.experts.adapters import EXPERTS_IMPLEMENTATION, MoeFamily, moe_layers
from shard.experts.dispatch import expert_ffn
from shard.experts.spec import SHARED, ExpertSpec
from shard.model.artifact import make_fingerprint, torch_recipe
from shard.model.st_manifest import model_root
from shard.model.torch_backend import DTYPES

__all__ = ["ExpertStore", "ExpertValidation", "VALIDATION_ROWS"]

# Validation rows per expert: a decode step and a small prefill chunk's worth.
VALIDATION_ROWS = 8
VALIDATION_SEED = 4321
_PROJ = ("gate", "up", "down")


@dataclass(frozen=True, slots=True)
class ExpertValidation:
    ok: bool
    detail: str
    experts: int
    ms_per_expert_row: float


class ExpertStore:
    def __init__(self, *, config, spec: ExpertSpec, dtype: str, routed: dict[tuple[int, int], tuple],
                 shared: dict[int, torch.nn.Module], fingerprint, model_path: Path) -> None:
        self.config = config
        self.spec = spec
        self.dtype_name = dtype
        self.torch_dtype = DTYPES[dtype][0]
        self.hidden_size = int(config.hidden_size)
        self.act_fn = ACT2FN[config.hidden_act]
        self._routed = routed
        self._shared = shared
        self.fingerprint = fingerprint
        self.model_path = model_path

    # -- loading -----------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, spec: ExpertSpec, *, dtype: str = "float32") -> ExpertStore:
        from transformers import AutoConfig

        from shard.model.adapters import adapter_for
        from shard.model.tensor_file import TensorFile

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        model_path = Path(path)
        files = sorted(model_path.glob("*.safetensors"))
        if not (model_path / "config.json").is_file() or not files:
            raise FileNotFoundError(f"{model_path} is not a model artifact (config.json + *.safetensors)")
        config = AutoConfig.from_pretrained(model_path).get_text_config(decoder=True)
        adapter = adapter_for(config)
        if not isinstance(adapter, MoeFamily):
            raise ValueError(f"{config.model_type} is not a mixture-of-experts model: it has no experts to serve")
        spec.check_model(num_layers=config.num_hidden_layers, num_experts=int(config.num_experts),
                         moe_layers=moe_layers(config), has_shared=adapter.has_shared_expert)
        if not len(spec):
            raise ValueError("an expert peer needs at least one expert to serve")
        torch_dtype = DTYPES[dtype][0]
        pieces: dict[tuple[int, int, str], torch.Tensor] = {}
        shared_state: dict[int, dict[str, torch.Tensor]] = {}
        for file in files:
            with TensorFile(file) as fh:   # owned tensors: no map of the file stays resident
                for key in fh.keys():
                    cls._read(fh, key, spec, pieces, shared_state, torch_dtype)
        routed = {}
        for layer in spec.layers:
            held = spec.experts_of(layer)
            if not held:
                continue
            try:
                gate_up = torch.stack([torch.cat([pieces[(layer, e, "gate")], pieces[(layer, e, "up")]], 0)
                                       for e in held])
                down = torch.stack([pieces[(layer, e, "down")] for e in held])
            except KeyError as exc:
                raise FileNotFoundError(f"{model_path} lacks expert {exc} of layer {layer}") from exc
            for i, expert in enumerate(held):
                routed[(layer, expert)] = (gate_up[i], down[i])
        shared = {layer: cls._shared_module(config, shared_state.get(layer, {}), layer, torch_dtype)
                  for layer in spec.layers if spec.has_shared(layer)}
        fingerprint = make_fingerprint(model_root(model_path), torch_recipe(dtype, adapter.adapter_name))
        return cls(config=config, spec=spec, dtype=dtype, routed=routed, shared=shared,
                   fingerprint=fingerprint, model_path=model_path)

    @staticmethod
    def _read(fh, key: str, spec: ExpertSpec, pieces, shared_state, torch_dtype) -> None:
        parts = key.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "mlp" or not parts[2].isdigit():
            return
        layer = int(parts[2])
        if parts[4] == "experts" and len(parts) == 8 and parts[5].isdigit() and parts[6].endswith("_proj"):
            expert, proj = int(parts[5]), parts[6][:-5]
            if (layer, expert) in spec.pairs and proj in _PROJ:
                pieces[(layer, expert, proj)] = fh.get_tensor(key).to(torch_dtype)
        elif parts[4] == "experts" and len(parts) == 6 and parts[5] in ("gate_up_proj", "down_proj"):
            held = spec.experts_of(layer)
            if held:   # fused checkpoint: read only the held experts' slices
                sl = fh.get_slice(key)
                for expert in held:
                    tensor = sl[expert].to(torch_dtype)
                    if parts[5] == "down_proj":
                        pieces[(layer, expert, "down")] = tensor
                    else:
                        half = tensor.shape[0] // 2
                        pieces[(layer, expert, "gate")], pieces[(layer, expert, "up")] = tensor[:half], tensor[half:]
        elif parts[4] == "shared_expert" and spec.has_shared(layer):
            shared_state.setdefault(layer, {})[".".join(parts[5:])] = fh.get_tensor(key).to(torch_dtype)

    @staticmethod
    def _shared_module(config, state: dict[str, torch.Tensor], layer: int, torch_dtype) -> torch.nn.Module:
        import importlib

        module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        mlp_cls = module.Qwen2MoeMLP
        with torch.device("meta"):
            mlp = mlp_cls(config, intermediate_size=config.shared_expert_intermediate_size)
        try:
            mlp.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise FileNotFoundError(f"the artifact lacks the shared expert of layer {layer}: {exc}") from exc
        return mlp.eval().requires_grad_(False).to(torch_dtype)

    # -- serving -----------------------------------------------------------------
    def serves(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.spec.pairs

    @property
    def weight_bytes(self) -> int:
        tensors = [t for pair in self._routed.values() for t in pair]
        tensors += [p for m in self._shared.values() for p in m.parameters()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def compute(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray:
        """One expert's unweighted output for float32 rows [n, hidden] (KeyError if not held)."""
        x = torch.from_numpy(np.array(rows, dtype=np.float32)).to(self.torch_dtype)
        with torch.inference_mode():
            if expert == SHARED:
                y = self._shared[layer](x)
            else:
                gate_up, down = self._routed[(layer, expert)]
                y = expert_ffn(gate_up, down, self.act_fn, x)
        return y.to(torch.float32).numpy()

    def validate(self) -> ExpertValidation:
        """Every held expert on seeded random rows: shapes and finiteness, timed."""
        rng = np.random.default_rng(VALIDATION_SEED)
        rows = rng.standard_normal((VALIDATION_ROWS, self.hidden_size)).astype(np.float32)
        t0 = time.perf_counter()
        try:
            for layer, expert in sorted(self.spec.pairs):
                out = self.compute(layer, expert, rows)
                if out.shape != rows.shape or not np.isfinite(out).all():
                    return ExpertValidation(False, f"expert {expert} of layer {layer} gave a bad output", 0, 0.0)
        except Exception as exc:  # noqa: BLE001 - the record says why, never a raw trace
            return ExpertValidation(False, f"validation forward failed ({type(exc).__name__})", 0, 0.0)
        elapsed = time.perf_counter() - t0
        n = len(self.spec)
        return ExpertValidation(True, f"validated {n} experts ({EXPERTS_IMPLEMENTATION}) by a real forward", n,
                                elapsed * 1000 / (n * VALIDATION_ROWS))
