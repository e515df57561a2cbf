"""Identity of what a shard executes: artifact digest, recipe digest, Fingerprint.

* The **artifact digest** names the bytes of a model artifact: sha256 over
  every file, in sorted relative-path order, of (path, size, bytes). A single
  file (a ``.gguf``) hashes as a one-file artifact named by its file name.
* The **recipe digest** names how those bytes are executed: backend, compute
  dtype, library versions (torch, transformers, or whatever the backend
  names) and the architecture adapter. Two peers agree on numerics only if
  both digests match, so both go into every ``pb.Fingerprint``.

Functions over the file system. The artifact digest is computed once per
file: ``shard/model/digests.py`` caches it on disk keyed by every file's (path,
size, mtime_ns, inode), so a restart, a LOAD directive or a worker respawn
never rehashes an unchanged model (and hashing a large one shows progress).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from proto import shard_runtime_pb2 as pb
from shard.model import digests

DIGEST_PREFIX = "sha256:"
# Version of the recipe description itself; bump if its fields change.
RECIPE_FORMAT = "meshd-recipe-v1"
# The framing of the artifact digest below (the digest cache keys on it).
ARTIFACT_SCHEME = "artifact-dir-v1"


def _files(root: Path) -> list[tuple[str, Path]]:
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise FileNotFoundError(f"model artifact {root} does not exist")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    return found


def artifact_digest(path: str | os.PathLike, progress: digests.Progress = None) -> str:
    """sha256 over every (sorted relative path, size, bytes) of the artifact; cached on disk per file set."""
    root = Path(path).resolve()
    files = _files(root)

    def frame(i: int, key: digests.FileKey) -> bytes:
        encoded = files[i][0].encode("utf-8")
        return len(encoded).to_bytes(4, "big") + encoded + key.size.to_bytes(8, "big")

    return digests.cached_digest(ARTIFACT_SCHEME, [p for _, p in files], frame, label=root.name, progress=progress)


@dataclass(frozen=True, slots=True)
class Recipe:
    """How an artifact is executed. ``libraries`` maps library name -> version."""

    backend: str
    dtype: str
    adapter: str
    libraries: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("backend", "dtype", "adapter"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Recipe.{name} must be a non-empty string")
        if tuple(sorted(self.libraries)) != self.libraries:
            raise ValueError("Recipe.libraries must be sorted (name, version) pairs")

    @property
    def recipe_id(self) -> str:
        return f"{self.backend}/{self.adapter}/{self.dtype}"

    def digest(self) -> str:
        lines = [RECIPE_FORMAT, f"backend={self.backend}", f"dtype={self.dtype}", f"adapter={self.adapter}"]
        lines += [f"lib:{name}={version}" for name, version in self.libraries]
        return DIGEST_PREFIX + hashlib.sha256("\n".join(lines).encode()).hexdigest()


# How the torch backend lays out and multiplies its weights (shard/model/adapters.py: the LM head and the
# Llama-family layers' projections input-major). Two ranges that differ here compute different last
# bits, so a replica of another layout is not interchangeable mid-generation: the recipe names it.
TORCH_LAYOUT = ("meshd.torch_layout", "input-major-2")


def torch_recipe(dtype: str, adapter: str) -> Recipe:
    """The recipe of the torch/transformers backend on this interpreter."""
    import torch
    import transformers

    libs = (TORCH_LAYOUT, ("torch", torch.__version__), ("transformers", transformers.__version__))
    return Recipe(backend="torch", dtype=dtype, adapter=adapter, libraries=tuple(sorted(libs)))


def make_fingerprint(artifact: str, recipe: Recipe, *, catalogue_version: str = "") -> pb.Fingerprint:
    """The wire Fingerprint: both digests, plus human labels."""
    return pb.Fingerprint(
        model_artifact_digest=artifact,
        runtime_recipe_digest=recipe.digest(),
        recipe_id=recipe.recipe_id,
        recipe_version=RECIPE_FORMAT,
        catalogue_version=catalogue_version,
    )


def fingerprints_match(a: pb.Fingerprint, b: pb.Fingerprint) -> bool:
    """Only the two digests decide; labels are for humans."""
    return (
        a.model_artifact_digest == b.model_artifact_digest
        and a.runtime_recipe_digest == b.runtime_recipe_digest
    )
