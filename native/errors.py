"""Errors of the GGUF side, placed in the meshd error tree (proto/errors.py).

    MeshdError
    ├── ArtifactError          the model FILE is unusable: truncated, corrupt, an
    │                          unsupported architecture or tensor type. Nobody's
    │                          request was wrong; re-create or re-download the file.
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

__all__ = ["ArtifactError", "RuntimeUnavailable", "RangeUnavailable"]


class ArtifactError(MeshdError):
    """The model file cannot be used as it is; fix or replace the file."""


class RuntimeUnavailable(MeshdError):
    """llama-cpp-python is not installed, or llama.cpp refused to load/run a model."""


class RangeUnavailable(LocalError):
    """A layer range outside the model (or an effective start outside the range)."""
