"""Cheap facts about a model artifact, read before the worker starts.

``model_num_layers(path)`` reads ``config.json`` of an artifact directory
(``num_hidden_layers``, or that of ``text_config``) or the ``<arch>.block_count``
field of a ``.gguf`` file (memory-mapped, no tensor is read), so that
``meshd join`` can refuse a missing path or a range beyond the model with one
clear line instead of a worker traceback minutes later.
"""
from __future__ import annotations

import json
from pathlib import Path

from meshd.errors import ConfigError, LayerRangeInvalid, ModelPathMissing

# config.json of a real model is a few KiB; refuse to parse anything huge.
MAX_CONFIG_JSON_BYTES = 4 << 20


def model_num_layers(path: Path) -> int:
    if not path.exists():
        raise ModelPathMissing(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"{path} is a file but not a .gguf; give an artifact directory or a .gguf")
        return _gguf_layers(path)
    config = path / "config.json"
    if not config.is_file():
        raise ModelPathMissing(f"{path} has no config.json; is it a model artifact directory?")
    if config.stat().st_size > MAX_CONFIG_JSON_BYTES:
        raise ConfigError(f"{config} is too large to be a model config")
    try:
        data = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config} is not valid JSON") from exc
    for section in (data, data.get("text_config") or {}):
        value = section.get("num_hidden_layers") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"{config} does not say num_hidden_layers")


def _gguf_layers(path: Path) -> int:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch_field = reader.fields["general.architecture"]
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
        block = reader.fields[f"{arch}.block_count"]
        return int(block.parts[block.data[0]][0])
    except (KeyError, ValueError, OSError) as exc:
        raise ConfigError(f"{path} is not a readable GGUF model ({exc})") from exc


def check_layers(path: Path, layers: tuple[int, int]) -> int:
    """Raise LayerRangeInvalid when [A, B) is not inside the model; return its layer count."""
    num_layers = model_num_layers(path)
    start, end = layers
    if not 0 <= start < end <= num_layers:
        raise LayerRangeInvalid(
            f"layers {start}:{end} are beyond the model: it has {num_layers} layers (use A:B with B <= {num_layers})")
    return num_layers
