"""Ollama's routes over the same core (pure, like openai.py): /api/chat, /api/generate, /api/tags,
/api/show, /api/ps, /api/embed, /api/embeddings.

Ollama streams by default: one JSON object per line (``application/x-ndjson``),
one per generated token, then a last object with ``done: true``,
``done_reason`` and the counts (``prompt_eval_count``, ``eval_count``) and
durations in nanoseconds. ``options`` carries the sampling settings
(``temperature``, ``top_p``, ``top_k``, ``seed``, ``num_predict``, ``stop``);
options we cannot honour are refused with 400, like OpenAI fields.
"""
from __future__ import annotations

import time
from datetime import UTC, datetime

from meshd.api.errors import ApiError, bad_field, excerpt
from meshd.api.openai import CHAT_DEFAULT_MAX_TOKENS, ROLE_ALIASES
from meshd.generate.params import MAX_NEW_TOKENS, GenerateParams
from proto.errors import LocalError

CHAT_FIELDS = {"model", "messages", "stream", "options", "format", "keep_alive", "tools", "think"}
GENERATE_FIELDS = {"model", "prompt", "system", "raw", "stream", "options", "format", "keep_alive", "template",
                   "context", "images", "suffix", "think"}
# Options that change nothing here (memory, threads, batching) are accepted and ignored.
IGNORED_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock",
                   "numa", "low_vram", "num_keep"}
SAMPLING_OPTIONS = {"temperature", "top_p", "top_k", "seed", "num_predict", "stop"}


def _now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _check(body: dict, known: set[str], served_model: str) -> bool:
    for key in body:
        if key not in known:
            raise bad_field(key, f"unknown field {excerpt(key)}")
    model = body.get("model")
    if not isinstance(model, str) or model.split(":")[0] != served_model:
        raise ApiError(404, f"model {excerpt(model)} not found; this swarm serves {served_model!r} (GET /api/tags)",
                       type="not_found_error", param="model", code="model_not_found")
    for name in ("format", "tools", "images", "context", "suffix", "template"):
        if body.get(name):
            raise bad_field(name, f"{name} is not supported by this server")
    if body.get("think"):
        raise bad_field("think", "thinking is not supported by this server")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_field("stream", "stream must be a boolean")
    return stream


def _options(body: dict) -> dict:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_field("options", "options must be an object")
    out: dict = {}
    for key, value in options.items():
        if key in IGNORED_OPTIONS:
            continue
        if key not in SAMPLING_OPTIONS:
            raise bad_field(f"options.{key}", f"option {excerpt(key)} is not supported by this server")
        if key == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value > MAX_NEW_TOKENS:
                raise bad_field("options.num_predict", f"num_predict must be -1 or 1..{MAX_NEW_TOKENS}")
            if value > 0:
                out["max_tokens"] = value
            elif value < 0:
                out["max_tokens"] = MAX_NEW_TOKENS
        elif key == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise bad_field("options.stop", "stop must be a list of strings")
            out["stop"] = tuple(value)
        else:
            out[key] = value
    return out


def _params(**fields) -> GenerateParams:
    try:
        return GenerateParams(**fields)
    except LocalError as exc:
        raise bad_field(None, str(exc)) from exc


def parse_chat(body: dict, served_model: str) -> tuple[GenerateParams, bool]:
    stream = _check(body, CHAT_FIELDS, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "messages must be a non-empty list")
    chat = []
    for i, m in enumerate(messages[:1024]):
        said = m.get("role") if isinstance(m, dict) else None
        role = ROLE_ALIASES.get(said) if isinstance(said, str) else None
        if role is None or not isinstance(m.get("content"), str) or m.get("images") or m.get("tool_calls"):
            raise bad_field(f"messages[{i}]", "each message needs a role (system, user, assistant) and text content")
        chat.append((role, m["content"]))
    fields = {"max_tokens": CHAT_DEFAULT_MAX_TOKENS, **_options(body)}
    return _params(messages=tuple(chat), **fields), stream


def parse_generate(body: dict, served_model: str) -> tuple[GenerateParams, bool]:
    stream = _check(body, GENERATE_FIELDS, served_model)
    prompt, system, raw = body.get("prompt"), body.get("system"), body.get("raw", False)
    if not isinstance(prompt, str) or not prompt:
        raise bad_field("prompt", "prompt must be a non-empty string")
    if not isinstance(raw, bool) or (system is not None and not isinstance(system, str)):
        raise bad_field("raw", "raw must be a boolean and system a string")
    fields = {"max_tokens": CHAT_DEFAULT_MAX_TOKENS, **_options(body)}
    if system and not raw:
        return _params(messages=(("system", system), ("user", prompt)), **fields), stream
    return _params(prompt=prompt, raw=raw, **fields), stream


class OllamaFormat:
    """Core events -> Ollama's lines (``chat``: ``message``; generate: ``response``)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.started = time.perf_counter_ns()
        self.first_token_ns: int | None = None
        self.prompt_tokens = 0
        self.text: list[str] = []
        self.done: dict | None = None
        self._tail = ""   # text released after the last token rides on the last line

    def _line(self, text: str, done: bool) -> dict:
        out: dict[str, object] = {"model": self.model, "created_at": _now_iso()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        out["done"] = done
        return out

    def on_event(self, event: dict) -> list[dict]:
        if event.get("event") == "start":
            self.prompt_tokens = int(event["prompt_tokens"])
            return []
        if event.get("done"):
            self.done = event
            return []
        if self.first_token_ns is None and "token" in event:
            self.first_token_ns = time.perf_counter_ns()
        text = event.get("text", "")
        self.text.append(text)
        if "token" not in event:
            self._tail += text
            return []
        return [self._line(text, False)]

    def _final(self, text: str) -> dict:
        done = self.done or {}
        now = time.perf_counter_ns()
        first = self.first_token_ns or now
        out = self._line(text, True)
        out.update({"done_reason": done.get("finish_reason", "length"), "total_duration": now - self.started,
                    "load_duration": 0, "prompt_eval_count": self.prompt_tokens,
                    "prompt_eval_duration": first - self.started,
                    "eval_count": int(done.get("completion_tokens", 0)), "eval_duration": now - first})
        return out

    def finish(self) -> list[dict]:
        return [self._final(self._tail)]

    def whole(self) -> dict:
        return self._final("".join(self.text))


# ---------------------------------------------------------------------------------- model routes
# Texts one embeddings request may carry (each is one pass through the swarm).
MAX_EMBED_INPUTS = 64
SHOW_FIELDS = {"model", "name", "verbose", "system", "template", "options"}
EMBED_FIELDS = {"model", "input", "truncate", "options", "keep_alive", "dimensions"}
EMBEDDINGS_FIELDS = {"model", "prompt", "options", "keep_alive"}


def _model_of(body: dict, served_model: str, known: set[str]) -> None:
    for key in body:
        if key not in known:
            raise bad_field(key, f"unknown field {excerpt(key)}")
    model = body.get("model", body.get("name"))
    if not isinstance(model, str) or model.split(":")[0] != served_model:
        raise ApiError(404, f"model {excerpt(model)} not found; this swarm serves {served_model!r} (GET /api/tags)",
                       type="not_found_error", param="model", code="model_not_found")


def tags_of(card) -> dict:
    """``/api/tags``: the swarm's model with its real size, family, parameter size and digest."""
    return {"models": [{"name": card.name, "model": card.name, "modified_at": card.modified_at,
                        "size": card.size_bytes, "digest": card.digest, "details": card.details()}]}


def show(body: dict, card) -> dict:
    """``/api/show``: what the model's files say (meshd/api/model_card.py)."""
    _model_of(body, card.name, SHOW_FIELDS)
    info = dict(card.model_info)
    if card.context_length:
        info.setdefault(f"{card.family}.context_length", card.context_length)
    return {"license": "", "modelfile": f"# served by a meshd swarm\nFROM {card.name}\n",
            "parameters": "", "template": card.template, "details": card.details(), "model_info": info,
            "capabilities": ["completion", "embedding"], "modified_at": card.modified_at}


def ps(card, *, expires_at: str, size_bytes: int) -> dict:
    """``/api/ps``: the model loaded on the swarm (every layer served), its bytes held across peers."""
    return {"models": [{"name": card.name, "model": card.name, "size": size_bytes, "digest": card.digest,
                        "details": card.details(), "expires_at": expires_at, "size_vram": 0,
                        "context_length": card.context_length}]}


def parse_embed(body: dict, served_model: str) -> tuple[list[str], bool]:
    """``/api/embed``: (texts, truncate)."""
    _model_of(body, served_model, EMBED_FIELDS)
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or len(texts) > MAX_EMBED_INPUTS or \
            not all(isinstance(t, str) for t in texts):
        raise bad_field("input", f"input must be a string or a list of 1..{MAX_EMBED_INPUTS} strings")
    if body.get("dimensions") is not None:
        raise bad_field("dimensions", "dimensions is not supported: the embedding is the model's hidden size")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad_field("truncate", "truncate must be a boolean")
    _options(body)
    return texts, truncate


def parse_embeddings(body: dict, served_model: str) -> str:
    """``/api/embeddings`` (the older route): one prompt."""
    _model_of(body, served_model, EMBEDDINGS_FIELDS)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_field("prompt", "prompt must be a non-empty string")
    _options(body)
    return prompt
