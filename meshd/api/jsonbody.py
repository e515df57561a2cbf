"""Untrusted JSON, parsed with bounds: size, nesting depth, no NaN/Infinity.

Python's ``json`` recurses once per nesting level: a 2 KB body of 1,000
``[`` raises ``RecursionError`` deep inside the parser (on the control socket
that escaped the connection handler and stopped the daemon). ``loads_bounded``
first walks the bytes once, counting open brackets outside strings, and
refuses anything deeper than ``MAX_JSON_DEPTH`` before the parser sees it;
then it parses with ``NaN``/``Infinity`` refused (not JSON, and a NaN
temperature poisons sampling). Every failure is ``BadJson`` (a LocalError:
the sender's fault), with a message that says what to fix.

Used by the HTTP API (meshd/api/app.py) and the control socket
(meshd/daemon/control.py). Pure; no I/O.
"""
from __future__ import annotations

import json
from typing import Any

from proto.errors import LocalError

# The deepest request we accept: an OpenAI chat body is about 5 levels deep
# (body -> messages -> message -> content parts -> part); 32 leaves room for
# response_format schemas while staying far below the interpreter's recursion
# limit (~1000 frames), whatever the caller's own stack depth.
MAX_JSON_DEPTH = 32
# Bytes of a control-socket or API body; the API's own bound is in app.py.
DEFAULT_MAX_JSON_BYTES = 1 << 20

# The parser's own reason, quoted in our message, is cut here (it may quote the body).
MAX_REASON_CHARS = 200

_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
_QUOTE = ord('"')
_BACKSLASH = ord("\\")


class BadJson(LocalError):
    """The body is not JSON we accept (malformed, too deep, too large, NaN, not an object)."""


class BadText(BadJson):
    """A string of the body is not Unicode scalar values (a lone surrogate); ``path`` says where."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path or 'the body'} holds a lone surrogate (U+D800..U+DFFF): every string must be "
                         "Unicode scalar values (valid UTF-8)")
        self.path = path


def _is_scalar_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _join(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_text(value: Any, path: str = "") -> None:
    """Raise BadText naming the first string (value or key) that is not Unicode scalar values.

    Iterative: the depth is already bounded, but a walk needs no stack either way. A bad key is
    named by its parent's path (its own text cannot be shown)."""
    todo = [(value, path)]
    while todo:
        item, where = todo.pop()
        if isinstance(item, str):
            if not _is_scalar_text(item):
                raise BadText(where)
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not _is_scalar_text(key):
                    raise BadText(f"a key of {where}" if where else "a key of the body")
                todo.append((sub, _join(where, key)))
        elif isinstance(item, list):
            todo.extend((sub, _join(where, i)) for i, sub in enumerate(item))


def json_depth(data: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """Deepest bracket nesting outside strings; stops counting (returns limit + 1) once over ``limit``."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == _BACKSLASH:
                escaped = True
            elif byte == _QUOTE:
                in_string = False
        elif byte == _QUOTE:
            in_string = True
        elif byte in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return limit + 1
        elif byte in _CLOSE:
            depth -= 1
    return deepest


def _no_constants(name: str) -> Any:
    raise BadJson(f"{name} is not a JSON number")


def loads_bounded(data: bytes | str, *, max_bytes: int = DEFAULT_MAX_JSON_BYTES,
                  max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON within the bounds above; raises BadJson."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise BadJson(f"the JSON body has {len(raw)} bytes, more than the {max_bytes} accepted")
    if json_depth(raw, max_depth) > max_depth:
        raise BadJson(f"the JSON body nests deeper than {max_depth} levels")
    try:
        value = json.loads(raw, parse_constant=_no_constants)
    except BadJson:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BadJson(f"the body is not valid JSON: {str(exc)[:MAX_REASON_CHARS]}") from exc
    check_text(value)
    return value


def loads_object(data: bytes | str, **bounds) -> dict:
    """``loads_bounded`` that also insists on a JSON object (every request we take is one)."""
    value = loads_bounded(data, **bounds)
    if not isinstance(value, dict):
        raise BadJson("the body must be a JSON object")
    return value
