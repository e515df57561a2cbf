"""What one generation is asked to do, validated when built (a bad field is the client's error).

``GenerateParams`` is the one request shape of the generate core
(meshd/generate/service.py), whichever edge it came through: the control
socket's ``{"op": "generate", ...}`` line (``from_request``) or the HTTP API
(meshd/api/openai.py builds it from an OpenAI or Ollama body). Either a
``prompt`` (chat template unless ``raw``) or chat ``messages`` (role, text).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshd.generate.textstream import check_stops
from proto.errors import LocalError
from shard.model.sampling import SamplingSpec

# Bounds on what a client may ask for: prompt size (all messages together),
# new tokens per request, messages per chat, alternatives per token (OpenAI's 20).
MAX_PROMPT_CHARS = 32_000
MAX_NEW_TOKENS = 4096
DEFAULT_MAX_TOKENS = 128
MAX_MESSAGES = 256
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "user", "assistant")
# Seeds are carried as unsigned 64-bit values on the wire.
MAX_SEED = 2**63 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class GenerateParams:
    prompt: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    raw: bool = False
    messages: tuple[tuple[str, str], ...] | None = None   # (role, text), through the chat template
    stop: tuple[str, ...] = ()
    logprobs: bool = False          # report each chosen token's log-probability
    top_logprobs: int = 0           # and this many alternatives per position
    topology: str = ""              # "push" | "star" for this request; "": the node's route_topology
    speculative: bool | None = None  # speculative decoding for this request; None: the node's setting

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise LocalError("give a prompt or messages (one of them)")
        if self.prompt is not None and (not isinstance(self.prompt, str)
                                        or not 0 < len(self.prompt) <= MAX_PROMPT_CHARS):
            raise LocalError(f"prompt must be a string of 1..{MAX_PROMPT_CHARS} characters")
        if self.messages is not None:
            if not isinstance(self.messages, tuple) or not 0 < len(self.messages) <= MAX_MESSAGES:
                raise LocalError(f"messages must hold 1..{MAX_MESSAGES} messages")
            total = 0
            for item in self.messages:
                if not (isinstance(item, tuple) and len(item) == 2 and item[0] in CHAT_ROLES
                        and isinstance(item[1], str)):
                    raise LocalError(f"each message needs a role ({', '.join(CHAT_ROLES)}) and text content")
                total += len(item[1])
            if total > MAX_PROMPT_CHARS:
                raise LocalError(f"the messages hold {total} characters, more than {MAX_PROMPT_CHARS}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_NEW_TOKENS:
            raise LocalError(f"max_tokens must be an integer in 1..{MAX_NEW_TOKENS}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise LocalError(f"{name} must be a number")
        if not 0 <= self.temperature <= 2:
            raise LocalError("temperature must be within 0..2")
        if not 0 < self.top_p <= 1:
            raise LocalError("top_p must be within (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise LocalError("top_k must be a non-negative integer")
        if not _is_int(self.seed) or not -MAX_SEED <= self.seed <= MAX_SEED:
            raise LocalError("seed must be an integer within a signed 64-bit range")
        if not isinstance(self.raw, bool) or not isinstance(self.logprobs, bool):
            raise LocalError("raw and logprobs must be booleans")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise LocalError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}")
        if self.top_logprobs and not self.logprobs:
            raise LocalError("top_logprobs needs logprobs")
        if not isinstance(self.stop, tuple):
            raise LocalError("stop must be a list of strings")
        check_stops(self.stop)
        if self.topology not in ("", "push", "star"):
            raise LocalError("topology must be push or star")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise LocalError("speculative must be a boolean")

    @classmethod
    def from_request(cls, request: dict) -> GenerateParams:
        """A control-socket request (``{"op": "generate", ...}``); unknown keys are ignored."""
        known = {"prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "raw", "logprobs",
                 "top_logprobs", "topology", "speculative"}
        fields = {k: v for k, v in request.items() if k in known}
        if "stop" in request:
            stop = request["stop"]
            fields["stop"] = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
        if "messages" in request:
            fields["messages"] = _messages(request["messages"])
        try:
            return cls(**fields)
        except TypeError as exc:
            raise LocalError(f"bad generate request: {exc}") from exc

    @property
    def seed_u64(self) -> int:
        return self.seed & (2**64 - 1)

    def sampling(self) -> SamplingSpec:
        return SamplingSpec(temperature=float(self.temperature), top_k=self.top_k, top_p=float(self.top_p),
                            seed=self.seed_u64)


def _messages(value) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list):
        raise LocalError("messages must be a list of {role, content} objects")
    out: list[tuple[Any, str]] = []   # roles are checked with the rest (GenerateParams)
    for item in value[:MAX_MESSAGES + 1]:
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise LocalError("each message must be an object with a role and a text content")
        out.append((item.get("role"), item["content"]))
    return tuple(out)
