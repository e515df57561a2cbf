"""Cheap facts about a model artifact, read before the worker starts.

``model_num_layers(path)`` reads ``config.json`` of an artifact directory
(``num_hidden_layers``, or that of ``text_config``) or the ``<arch>.block_count``
field of a ``.gguf`` file (the bounded reader, native/gguf_file.py: memory-mapped,
no tensor is read; a malformed file is one ConfigError line), so that
``meshd join`` can refuse a missing path or a range beyond the model with one
clear line instead of a worker traceback minutes later. ``held_layers`` names
the layers a GGUF slice or a partial directory holds; ``model_digest`` is the
model's id, the Merkle root of either kind (the only digest function the
daemon calls).
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
    from native.errors import ArtifactError
    from native.gguf_range import model_info, open_reader

    try:
        return model_info(open_reader(path)).num_layers
    except ArtifactError as exc:
        raise ConfigError(f"{path} is not a usable GGUF model: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc}") from exc


def model_context_tokens(path: Path) -> int:
    """The model's trained context (config.json max_position_embeddings, GGUF context_length);
    0 when the artifact does not say (then no context check is made)."""
    try:
        if path.is_file():
            from native.gguf_range import model_info, open_reader

            return int(model_info(open_reader(path)).context_length or 0)
        config = path / "config.json"
        if not config.is_file() or config.stat().st_size > MAX_CONFIG_JSON_BYTES:
            return 0
        data = json.loads(config.read_text())
    except Exception:  # noqa: BLE001 - an unreadable model is reported by model_num_layers, not here
        return 0
    for section in (data, data.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return 0


def held_layers(path: Path) -> tuple[int, int] | None:
    """The layers a GGUF slice or a partial directory (a fetch) holds, or None for a whole model."""
    if path.is_dir():
        from shard.errors import ArtifactError
        from shard.model.st_manifest import held_layers as partial_layers

        try:
            partial = partial_layers(path)
        except ArtifactError as exc:
            raise ConfigError(str(exc)) from exc
        return None if partial is None or (partial[0], partial[1]) == (0, partial[2]) else (partial[0], partial[1])
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    from native.errors import ArtifactError
    from native.gguf_range import held_range, open_reader

    try:
        held = held_range(open_reader(path))
    except ArtifactError as exc:
        raise ConfigError(f"{path} is not a usable GGUF model: {exc}") from exc
    return None if (held.start, held.end) == (0, held.num_layers) else (held.start, held.end)


def model_digest(path: Path, progress=None) -> str:
    """The model's id: the Merkle root of its manifest -- a directory's (shard/model/st_manifest.py) or a
    GGUF's (native/gguf_manifest.py); a slice or a partial directory names its source's root.

    The one place the daemon asks; workers compute the same value for their fingerprints.
    """
    if path.is_file():
        from native.gguf_range import model_digest as gguf_digest

        return gguf_digest(path, progress)
    from shard.model.st_manifest import model_root

    return model_root(path)


def check_layers(path: Path, layers: tuple[int, int]) -> int:
    """Raise LayerRangeInvalid when [A, B) is not inside the model; return its layer count."""
    num_layers = model_num_layers(path)
    start, end = layers
    if not 0 <= start < end <= num_layers:
        raise LayerRangeInvalid(
            f"layers {start}:{end} are beyond the model: it has {num_layers} layers (use A:B with B <= {num_layers})")
    held = held_layers(path)
    if held is not None and not held[0] <= start < end <= held[1]:
        raise LayerRangeInvalid(f"{path.name} is a slice holding layers {held[0]}:{held[1]}; "
                                f"serve a range inside it, not {start}:{end}")
    return num_layers
