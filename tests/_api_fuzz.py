"""Hypothesis strategies for hostile requests to every API route (tests/test_api_fuzz.py and the slow swarm run).

A request is (method, path, query, headers, body bytes). Bodies start from a
valid request of the route and are mutated: any string replaced by arbitrary
Unicode (lone surrogates included, written as JSON escapes or as the raw bytes
ED A0 80), keys added with arbitrary names and values, types swapped, the
whole body replaced by arbitrary bytes. Valid generations stay short
(max_tokens / num_predict 1-2) so thousands of cases fit in seconds.
"""
from __future__ import annotations

import json
import urllib.parse

from hypothesis import strategies as st

# Every code point, surrogates included (hypothesis leaves out category Cs by default).
ANY_CHAR = st.characters(exclude_categories=())
ANY_TEXT = st.text(ANY_CHAR, max_size=24)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    ANY_TEXT)
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(ANY_TEXT, inner, max_size=3)),
                       max_leaves=8)

GET_PATHS = ("/", "/static/dashboard.js", "/static/nope.js", "/meshd/status", "/metrics", "/v1/models",
             "/api/tags", "/api/version", "/api/ps", "/favicon.ico", "/v1/nope")


def bases(model: str) -> dict[str, dict]:
    chat = [{"role": "user", "content": "hi"}]
    return {
        "/v1/chat/completions": {"model": model, "messages": chat, "max_tokens": 1},
        "/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 1},
        "/api/chat": {"model": model, "messages": chat, "stream": False, "options": {"num_predict": 1}},
        "/api/generate": {"model": model, "prompt": "hi", "system": "s", "stream": False,
                          "options": {"num_predict": 1}},
        "/api/show": {"model": model},
        "/api/embed": {"model": model, "input": ["hi", "there"]},
        "/api/embeddings": {"model": model, "prompt": "hi"},
        "/v1/embeddings": {"model": model, "input": "hi"},
    }


def _paths(value, at=()):
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, at + (i,))


def _set(value, path, new):
    if not path:
        return new
    out = dict(value) if isinstance(value, dict) else list(value)
    out[path[0]] = _set(value[path[0]], path[1:], new)
    return out


@st.composite
def mutated(draw, base: dict):
    body = base
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(("replace", "string", "key", "drop")))
        paths = list(_paths(body))
        path = draw(st.sampled_from(paths))
        if kind == "replace":
            body = _set(body, path, draw(JSONISH))
        elif kind == "string":
            body = _set(body, path, draw(ANY_TEXT))
        elif kind == "key" and isinstance(body, dict):
            body = {**body, draw(ANY_TEXT): draw(JSONISH)}
        elif kind == "drop" and isinstance(body, dict) and body:
            body = {k: v for k, v in body.items() if k != draw(st.sampled_from(sorted(body)))}
    return body


def encode(body, raw_surrogates: bool) -> bytes:
    if raw_surrogates:   # surrogates as the bytes ED A0 80 (json.loads lets them through with surrogatepass)
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body).encode()


# Header values h11 lets a client send: visible latin-1, no whitespace at either end.
HEADER_VALUE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"),
                       max_size=40)


@st.composite
def requests(draw, model: str):
    """(method, path, query, headers, body) for any route."""
    headers = {}
    for name in draw(st.lists(st.sampled_from(("x-junk", "accept", "user-agent", "authorization", "origin",
                                               "accept-encoding", "cookie")), max_size=3, unique=True)):
        headers[name] = draw(HEADER_VALUE).encode("latin-1")
    query = urllib.parse.quote(draw(ANY_TEXT).encode("utf-8", "surrogatepass"), safe="=&")
    if draw(st.booleans()):
        path = draw(st.sampled_from(GET_PATHS))
        return "GET", path, query, headers, b""
    path, base = draw(st.sampled_from(sorted(bases(model).items())))
    headers["content-type"] = draw(st.sampled_from((b"application/json", b"application/json; charset=utf-8",
                                                    b"application/json", b"text/plain")))
    if draw(st.integers(0, 9)) == 0:
        return "POST", path, query, headers, draw(st.binary(max_size=64))
    return "POST", path, query, headers, encode(draw(mutated(base)), draw(st.booleans()))
