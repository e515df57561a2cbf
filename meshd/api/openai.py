"""OpenAI's chat and completions bodies -> GenerateParams; core events -> OpenAI responses.

Pure (no I/O): ``parse_chat`` / ``parse_completion`` take the decoded JSON
body and return the core's ``GenerateParams`` plus how to answer
(``Answer``: stream or not, usage in the stream, logprobs), or raise
``ApiError`` 400 naming the field. What we cannot do is refused, never
ignored: ``n`` > 1, tools and functions, JSON response formats, penalties,
logit bias, audio -- and, as OpenAI does, any field we do not know.

``ChatFormat`` / ``CompletionFormat`` turn the core's events (see
meshd/generate/service.py) into the response: one stream chunk per
generated token (its text may be empty while a stop string is held back or
a character is incomplete), so a client that counts chunks counts tokens;
the role rides on the first chunk; the last chunk carries the held-back
text if any and ``finish_reason``; with ``stream_options.include_usage`` a
final chunk with empty ``choices`` carries ``usage``.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from meshd.api.errors import ApiError, bad_field, excerpt
from meshd.generate.params import MAX_NEW_TOKENS, MAX_TOP_LOGPROBS, GenerateParams
from proto.errors import LocalError

# Defaults when the body does not say (OpenAI's legacy completions default is 16).
CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16
# Legacy completions ask for logprobs as an integer of alternatives, at most 5.
MAX_COMPLETION_LOGPROBS = 5

_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
           "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "functions", "function_call", "parallel_tool_calls", "response_format", "metadata",
                         "store", "service_tier", "modalities", "audio", "prediction", "reasoning_effort"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True, slots=True)
class Answer:
    """How to answer one request (beside what to generate)."""

    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None   # None: no logprobs; else alternatives per token


def _unknown(body: dict, known: set[str]) -> None:
    for key in body:
        if key not in known:
            raise bad_field(key, f"Unrecognized request argument supplied: {excerpt(key)}")


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad_field(name, f"{name} must be an integer in {lo}..{hi}")
    return value


def _number(body: dict, name: str, lo: float, hi: float, *, open_lo: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (lo < value if open_lo else lo <= value) and value <= hi):
        raise bad_field(name, f"{name} must be a number in {'(' if open_lo else '['}{lo}, {hi}]")
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(name, f"{name} must be a boolean")
    return value


def _refuse_unless(body: dict, name: str, ok) -> None:
    if name in body and not ok(body[name]):
        raise bad_field(name, f"{name} is not supported by this server (meshd serves plain text generation)")


def _common(body: dict, served_model: str) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_field("model", "model is required: the id from GET /v1/models")
    if model != served_model:
        raise ApiError(404, f"The model {excerpt(model)} does not exist here; this swarm serves `{served_model}` "
                            "(GET /v1/models)", type="not_found_error", param="model", code="model_not_found")
    _refuse_unless(body, "n", lambda v: v is None or (v == 1 and not isinstance(v, bool)))
    for name in ("presence_penalty", "frequency_penalty"):
        _refuse_unless(body, name, lambda v: v is None or (isinstance(v, (int, float)) and v == 0))
    _refuse_unless(body, "logit_bias", lambda v: not v)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_field("user", "user must be a string")
    stop = body.get("stop")
    if stop is None:
        stops: tuple = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad_field("stop", "stop must be a string or a list of strings")
    options = body.get("stream_options")
    stream = _bool(body, "stream")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise bad_field("stream_options", "stream_options accepts include_usage only")
        if not stream:
            raise bad_field("stream_options", "stream_options needs stream: true")
    include_usage = bool(options and options.get("include_usage") is True)
    fields = {"stop": stops, "temperature": _number(body, "temperature", 0.0, 2.0),
              "top_p": _number(body, "top_p", 0.0, 1.0, open_lo=True), "seed": _int(body, "seed", -2**63, 2**63 - 1),
              "top_k": _int(body, "top_k", 0, 1 << 20)}
    return {"fields": {k: v for k, v in fields.items() if v is not None}, "stream": stream,
            "include_usage": include_usage}


def _params(param_of_error: dict[str, str], **fields) -> GenerateParams:
    try:
        return GenerateParams(**fields)
    except LocalError as exc:
        text = str(exc)
        param = next((p for key, p in param_of_error.items() if text.startswith(key)), None)
        raise bad_field(param, text) from exc


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_field(f"messages[{index}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_field(f"messages[{index}].content", "content must be a string or a list of text parts")


def parse_chat(body: dict, served_model: str) -> tuple[GenerateParams, Answer]:
    _unknown(body, CHAT_FIELDS)
    common = _common(body, served_model)
    _refuse_unless(body, "tools", lambda v: not v)
    _refuse_unless(body, "functions", lambda v: not v)
    _refuse_unless(body, "tool_choice", lambda v: v in (None, "none"))
    _refuse_unless(body, "function_call", lambda v: v in (None, "none"))
    _refuse_unless(body, "response_format", lambda v: v is None or v == {"type": "text"})
    _refuse_unless(body, "modalities", lambda v: v is None or v == ["text"])
    for name in ("audio", "prediction"):
        _refuse_unless(body, name, lambda v: v is None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "messages must be a non-empty list")
    chat = []
    for i, message in enumerate(messages[:1024]):
        if not isinstance(message, dict):
            raise bad_field(f"messages[{i}]", "each message must be an object")
        said = message.get("role")
        role = ROLE_ALIASES.get(said) if isinstance(said, str) else None
        if role is None:
            raise bad_field(f"messages[{i}].role", "role must be system, developer, user or assistant "
                                                   "(tool messages are not supported)")
        if message.get("tool_calls") or message.get("function_call"):
            raise bad_field(f"messages[{i}].tool_calls", "tool calls are not supported")
        chat.append((role, _content(message, i)))
    max_tokens = _int(body, "max_completion_tokens", 1, MAX_NEW_TOKENS)
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1, MAX_NEW_TOKENS)
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad_field("top_logprobs", "top_logprobs needs logprobs: true")
    params = _params({"messages": "messages", "stop": "stop", "each stop": "stop", "at most": "stop"},
                     messages=tuple(chat), max_tokens=max_tokens or CHAT_DEFAULT_MAX_TOKENS,
                     logprobs=logprobs, top_logprobs=top or 0, **common["fields"])
    return params, Answer(served_model, common["stream"], common["include_usage"], (top or 0) if logprobs else None)


def parse_completion(body: dict, served_model: str) -> tuple[GenerateParams, Answer]:
    _unknown(body, COMPLETION_FIELDS)
    common = _common(body, served_model)
    _refuse_unless(body, "echo", lambda v: not v)
    _refuse_unless(body, "best_of", lambda v: v is None or v == 1)
    _refuse_unless(body, "suffix", lambda v: v is None)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_field("prompt", "prompt must be a non-empty string (one prompt per request)")
    max_tokens = _int(body, "max_tokens", 1, MAX_NEW_TOKENS)
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    params = _params({"prompt": "prompt", "stop": "stop", "each stop": "stop", "at most": "stop"},
                     prompt=prompt, raw=True, max_tokens=max_tokens or COMPLETION_DEFAULT_MAX_TOKENS,
                     logprobs=logprobs is not None, top_logprobs=logprobs or 0, **common["fields"])
    return params, Answer(served_model, common["stream"], common["include_usage"], logprobs)


# ---------------------------------------------------------------------------------------- responses

def _usage(prompt: int, completion: int, done: dict | None = None) -> dict:
    usage: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    drafted = int((done or {}).get("drafted_tokens", 0))
    if drafted:   # speculative decoding: OpenAI's names for predicted tokens kept and thrown away
        accepted = int((done or {}).get("accepted_tokens", 0))
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted}
    return usage


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class _Format:
    object_name = ""
    prefix = chunk_object = ""   # set by each format

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.text: list[str] = []
        self.logprobs: list = []
        self.prompt_tokens = 0
        self.done: dict | None = None
        self._tail = ""          # text released after the last token: rides on the last chunk
        self._role_sent = False

    def _chunk(self, choice: dict | None, usage: dict | None = None, *, usage_key: bool = True) -> dict:
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.answer.model,
               "choices": [choice] if choice is not None else []}
        if self.answer.include_usage and usage_key:
            out["usage"] = usage
        return out

    def on_event(self, event: dict) -> list[dict]:
        """Stream chunks for one core event (also accumulated for the whole answer)."""
        if event.get("event") == "start":
            self.prompt_tokens = int(event["prompt_tokens"])
            return []
        if event.get("done"):
            self.done = event
            return []
        text = event.get("text", "")
        self.text.append(text)
        if "token" not in event:
            self._tail += text
            return []
        entry = self._logprob(event) if self.answer.logprobs is not None else None
        if entry is not None:
            self.logprobs.append(entry)
        return [self._chunk(self._token_choice(text, entry))]

    def finish(self) -> list[dict]:
        done = self.done or {}
        reason = done.get("finish_reason", "length")
        usage = _usage(self.prompt_tokens, int(done.get("completion_tokens", 0)), done)
        out = [self._chunk(self._final_choice(self._tail, reason))]
        if self.answer.include_usage:
            out.append(self._chunk(None, usage))
        return out

    def usage(self) -> dict:
        return _usage(self.prompt_tokens, int((self.done or {}).get("completion_tokens", 0)), self.done)

    # -- what each format says its own way
    def _logprob(self, event: dict) -> dict:
        raise NotImplementedError

    def _token_choice(self, text: str, entry: dict | None) -> dict:
        raise NotImplementedError

    def _final_choice(self, tail: str, reason: str) -> dict:
        raise NotImplementedError


class ChatFormat(_Format):
    prefix, chunk_object = "chatcmpl", "chat.completion.chunk"

    def _logprob(self, event: dict) -> dict:
        piece = event.get("piece", "")
        return {"token": piece, "logprob": event.get("logprob"), "bytes": _bytes(piece),
                "top_logprobs": [{"token": t["piece"], "logprob": t["logprob"], "bytes": _bytes(t["piece"])}
                                 for t in event.get("top_logprobs", [])[:self.answer.logprobs]]}

    def _token_choice(self, text: str, entry: dict | None) -> dict:
        delta = {"content": text}
        if not self._role_sent:
            delta = {"role": "assistant", "content": text}
            self._role_sent = True
        return {"index": 0, "delta": delta, "logprobs": {"content": [entry]} if entry else None,
                "finish_reason": None}

    def _final_choice(self, tail: str, reason: str) -> dict:
        delta = {"content": tail} if tail else {}
        if not self._role_sent:
            delta["role"] = "assistant"
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    def whole(self) -> dict:
        done = self.done or {}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.answer.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(self.text),
                                                     "refusal": None},
                             "logprobs": {"content": self.logprobs} if self.answer.logprobs is not None else None,
                             "finish_reason": done.get("finish_reason", "length")}],
                "usage": self.usage()}


class CompletionFormat(_Format):
    prefix, chunk_object = "cmpl", "text_completion"

    def _logprob(self, event: dict) -> dict:
        return {"token": event.get("piece", ""), "logprob": event.get("logprob"),
                "top": {t["piece"]: t["logprob"] for t in event.get("top_logprobs", [])[:self.answer.logprobs]}}

    @staticmethod
    def _legacy(entries: list[dict], offset: int = 0) -> dict:
        offsets, at = [], offset
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries], "text_offset": offsets}

    def _token_choice(self, text: str, entry: dict | None) -> dict:
        return {"index": 0, "text": text, "logprobs": self._legacy([entry]) if entry else None,
                "finish_reason": None}

    def _final_choice(self, tail: str, reason: str) -> dict:
        return {"index": 0, "text": tail, "logprobs": None, "finish_reason": reason}

    def whole(self) -> dict:
        done = self.done or {}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.answer.model,
                "choices": [{"index": 0, "text": "".join(self.text),
                             "logprobs": self._legacy(self.logprobs) if self.answer.logprobs is not None else None,
                             "finish_reason": done.get("finish_reason", "length")}],
                "usage": self.usage()}


EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
# Texts one request may carry (each is one pass through the swarm).
MAX_EMBEDDING_INPUTS = 64


def parse_embeddings(body: dict, served_model: str) -> tuple[list[str], str]:
    """``/v1/embeddings``: (the texts, "float" | "base64"); token-id inputs are refused: the entry tokenizes.
    The official client asks for base64 (little-endian float32) by default."""
    _unknown(body, EMBEDDING_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or model != served_model:
        raise ApiError(404, f"The model {excerpt(model)} does not exist here; this swarm serves `{served_model}` "
                            "(GET /v1/models)", type="not_found_error", param="model", code="model_not_found")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or len(texts) > MAX_EMBEDDING_INPUTS or \
            not all(isinstance(t, str) and t for t in texts):
        raise bad_field("input", f"input must be a non-empty string or a list of 1..{MAX_EMBEDDING_INPUTS} "
                                 "non-empty strings (token ids are not supported)")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_field("encoding_format", "encoding_format must be float or base64")
    _refuse_unless(body, "dimensions", lambda v: v is None)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_field("user", "user must be a string")
    return texts, encoding


def embeddings_answer(model: str, vectors: list[list[float]], prompt_tokens: int, encoding: str = "float") -> dict:
    def encoded(v: list[float]):
        if encoding == "base64":
            import base64

            import numpy as np

            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        return v
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
