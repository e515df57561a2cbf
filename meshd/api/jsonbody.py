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

_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
_QUOTE = ord('"')
_BACKSLASH = ord("\\")


class BadJson(LocalError):
    """The body is not JSON we accept (malformed, too deep, too large, NaN, not an object)."""


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
        return json.loads(raw, parse_constant=_no_constants)
    except BadJson:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BadJson(f"the body is not valid JSON: {exc}") from exc


def loads_object(data: bytes | str, **bounds) -> dict:
    """``loads_bounded`` that also insists on a JSON object (every request we take is one)."""
    value = loads_bounded(data, **bounds)
    if not isinstance(value, dict):
        raise BadJson("the body must be a JSON object")
    return value
