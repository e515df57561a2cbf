"""Errors of the GGUF side, placed in the meshd error tree (proto/errors.py).

    MeshdError
    ├── ArtifactError          the model FILE is unusable: truncated, corrupt, an
    │                          unsupported architecture or tensor type. Nobody's
    │                          request was wrong; re-create or re-download the file.
    │                          (defined in shard/errors.py, shared with the torch backend)
    ├── RuntimeUnavailable     the native runtime (llama-cpp-python) is missing or
    │                          failed inside; install the [native] extra
    └── LocalError
        └── RangeUnavailable   we were asked for a layer range the model does not
                               have (our caller's bug or a wrong CLI argument)

Foreign errors (numpy memmap, gguf's ValueError, llama.cpp return codes) are
mapped here with ``raise ... from exc`` so callers see one tree.
"""
from __future__ import annotations

from proto.errors import LocalError, MeshdError
from shard.errors import ArtifactError

__all__ = ["ArtifactError", "RuntimeUnavailable", "KvCellsExhausted", "RangeUnavailable"]


class RuntimeUnavailable(MeshdError):
    """llama-cpp-python is not installed, or llama.cpp refused to load/run a model."""


class KvCellsExhausted(RuntimeUnavailable):
    """llama_decode found no free KV cells for the batch (return code 1): a budget shortfall."""


class RangeUnavailable(LocalError):
    """A layer range outside the model (or an effective start outside the range)."""
