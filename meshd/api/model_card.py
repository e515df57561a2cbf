"""What Ollama's clients ask about a model, read from the model's own files (``/api/show``, ``/api/tags``).

    ModelCard.read(path, model_id, digest)
        .gguf       the GGUF metadata (bounded reader, native/gguf_file.py: memory-mapped, no
                    tensor data read): general.architecture, <arch>.context_length,
                    general.file_type (the quantization), tokenizer.chat_template; parameters
                    counted from the tensor table; size = the file's bytes
        directory   config.json (model_type, max_position_embeddings, torch_dtype), the
                    safetensors headers (parameters), chat_template.jinja or
                    tokenizer_config.json's chat_template; size = the weight files' bytes

``digest`` is the model's id the swarm already agrees on (its Merkle root,
``merkle:<64 hex>``, the value every peer's record carries), shown in Ollama's
form: the root is a SHA-256, so Ollama's clients get ``sha256:<the same 64 hex>``. Read once per daemon (the files do
not change under a running worker) and cached by the API part. Pure apart from
reading the files.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

# A model's config.json / tokenizer_config.json is a few KiB; a safetensors header a few MB at most.
MAX_CONFIG_BYTES = 4 << 20
MAX_SAFETENSORS_HEADER_BYTES = 64 << 20
# Metadata values shown in model_info: scalars only, strings cut here (templates have their own field).
MAX_INFO_CHARS = 256
TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class ModelCard:
    name: str
    digest: str
    format: str                       # "gguf" | "safetensors"
    family: str
    parameter_count: int
    quantization_level: str
    context_length: int
    template: str
    size_bytes: int
    modified_at: str
    model_info: dict = field(default_factory=dict)

    @property
    def parameter_size(self) -> str:
        """Ollama's short form: 135M, 1.2B."""
        n = self.parameter_count
        if n >= 10**9:
            return f"{n / 1e9:.1f}B"
        return f"{n / 1e6:.0f}M" if n >= 10**6 else str(n)

    def details(self) -> dict:
        return {"parent_model": "", "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": self.parameter_size, "quantization_level": self.quantization_level}

    @classmethod
    def read(cls, path: Path, model_id: str, digest: str | None) -> ModelCard:
        path = Path(path)
        modified = datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat().replace("+00:00", "Z")
        read = _gguf if path.is_file() else _directory
        if digest and digest.startswith("merkle:"):
            digest = "sha256:" + digest.removeprefix("merkle:")
        return cls(name=model_id, digest=digest or "", modified_at=modified, **read(path))


def _scalar_info(items) -> dict:
    out: dict[str, bool | int | float | str] = {}
    for key, value in items:
        if isinstance(value, (bool, int, float)):
            out[key] = value
        elif isinstance(value, str) and len(value) <= MAX_INFO_CHARS:
            out[key] = value
    return out


def _gguf(path: Path) -> dict:
    import gguf

    from native.gguf_file import GGUFFile

    g = GGUFFile.open(path)
    arch = str(g.value("general.architecture", "") or "")
    try:
        quant = gguf.LlamaFileType(int(g.value("general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        quant = ""
    params = sum(t.n_elements for t in g.tensors.values()) if isinstance(g.tensors, dict) else \
        sum(t.n_elements for t in g.tensors)
    info = _scalar_info((k, f.contents()) for k, f in g.fields.items() if not k.startswith("tokenizer."))
    info["general.parameter_count"] = params
    return {"format": "gguf", "family": arch, "parameter_count": params, "quantization_level": quant,
            "context_length": int(g.value(f"{arch}.context_length", 0) or 0),
            "template": str(g.value("tokenizer.chat_template", "") or ""), "size_bytes": path.stat().st_size,
            "model_info": info}


def _json(path: Path) -> dict:
    if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _safetensors_params(path: Path) -> int:
    """Elements of every tensor in a .safetensors file, from its JSON header (8-byte length first)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > MAX_SAFETENSORS_HEADER_BYTES:
            return 0
        header = json.loads(fh.read(length))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__" and isinstance(entry, dict):
            n = 1
            for dim in entry.get("shape", []):
                n *= int(dim)
            total += n
    return total


def _directory(path: Path) -> dict:
    config = _json(path / "config.json")
    text_config = config.get("text_config")
    text = text_config if isinstance(text_config, dict) else {}
    weights = sorted(path.glob("*.safetensors"))
    template_file = path / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else \
        str(_json(path / "tokenizer_config.json").get("chat_template") or "")
    family = str(config.get("model_type") or "")
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings") or 0
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    info = _scalar_info((f"{family}.{k}", v) for k, v in {**text, **config}.items())
    params = sum(_safetensors_params(w) for w in weights)
    info["general.architecture"], info["general.parameter_count"] = family, params
    return {"format": "safetensors", "family": family, "parameter_count": params,
            "quantization_level": TORCH_DTYPES.get(dtype, dtype.upper()), "context_length": int(context),
            "template": template, "size_bytes": sum(w.stat().st_size for w in weights), "model_info": info}
