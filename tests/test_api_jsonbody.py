"""Bounded JSON (meshd/api/jsonbody.py) and the control socket surviving hostile bodies.

The report that started this: a 2 KB request nested 1,000 levels deep made
``json.loads`` raise RecursionError inside the control socket's connection
handler, and the daemon exited. Now the depth is checked before parsing, the
socket answers with a clear error, and the next request is served.
"""
from __future__ import annotations

import json
import socket

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.api.jsonbody import MAX_JSON_DEPTH, BadJson, json_depth, loads_bounded, loads_object
from meshd.daemon.control import request as control_request
from meshd.daemon.control import serve_control

DEEP = b'{"op": "generate", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}\n"


def test_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'"[[[[[[[[[["') == 0
    assert json_depth(b'["\\"[[[[", [[]]]') == 3      # an escaped quote does not end the string
    assert json_depth(b"[" * 10_000, limit=8) == 9      # stops counting past the limit


def test_deep_large_nan_and_non_objects_are_refused_with_a_reason():
    assert len(DEEP) < 2100
    with pytest.raises(BadJson, match="deeper than 32"):
        loads_bounded(DEEP)
    with pytest.raises(BadJson, match="more than the 10 accepted"):
        loads_bounded(b'{"a": "0123456789"}', max_bytes=10)
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        with pytest.raises(BadJson, match="not a JSON number"):
            loads_bounded(b'{"temperature": ' + constant + b"}")
    with pytest.raises(BadJson, match="not valid JSON"):
        loads_bounded(b'{"a": ')
    with pytest.raises(BadJson, match="not valid JSON"):
        loads_bounded(b"\xff\xfe")
    with pytest.raises(BadJson, match="must be a JSON object"):
        loads_object(b"[1, 2]")
    nested = json.dumps(_nest(MAX_JSON_DEPTH)).encode()
    assert loads_bounded(nested) == _nest(MAX_JSON_DEPTH)   # exactly at the bound is fine
    with pytest.raises(BadJson):
        loads_bounded(json.dumps(_nest(MAX_JSON_DEPTH + 1)).encode())


def _nest(depth: int):
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(alphabet='[]{}":,\\ a1', max_size=300).map(str.encode))
def test_any_bytes_parse_or_raise_badjson(data):
    try:
        loads_bounded(data)
    except BadJson:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=20))
def test_valid_json_within_bounds_round_trips(value):
    assert loads_bounded(json.dumps(value).encode()) == value


def _raw_exchange(path, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(payload)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def test_control_socket_answers_a_deeply_nested_request_and_keeps_serving(tmp_path):
    path = tmp_path / "c.sock"
    streamed = []

    async def handler(req: dict) -> dict:
        return {"peer_id": "me"}

    async def stream_handler(req: dict, send) -> None:
        streamed.append(req)
        await send({"done": True})

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_control(path, handler, stream_handler=stream_handler,
                                                                   task_status=task_status))
            replies = []
            for payload in (DEEP, b"[" * 2000 + b"\n", b'{"op": "ping", "x": NaN}\n'):
                replies.append(await trio.to_thread.run_sync(_raw_exchange, path, payload))
            ping = await trio.to_thread.run_sync(control_request, path, "ping")
            nursery.cancel_scope.cancel()
        return replies, ping

    replies, ping = trio.run(main)
    for reply in replies:
        assert reply["ok"] is False and "bad request" in reply["error"], reply
    assert "deeper than" in replies[0]["error"]
    assert ping["peer_id"] == "me" and not streamed


def test_lone_surrogates_are_refused_naming_where_they_sit():
    from meshd.api.jsonbody import BadText

    cases = [(b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
             (b'{"prompt": "a \\udfff b"}', "prompt"),
             ('{"prompt": "raw \udcff"}'.encode("utf-8", "surrogatepass"), "prompt"),   # bytes ED B3 BF
             (b'{"options": {"\\ud800": 1}}', "a key of options"),
             (b'{"stop": ["ok", "\\udc00"]}', "stop[1]")]
    for body, where in cases:
        with pytest.raises(BadText) as info:
            loads_object(body)
        assert str(info.value).startswith(where)
    assert loads_object(b'{"prompt": "\\ud83d\\ude00 pairs are fine"}')["prompt"] == "\U0001F600 pairs are fine"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_string_either_parses_to_valid_unicode_or_is_refused(text):
    body = json.dumps({"prompt": text}).encode()          # ensure_ascii: surrogates travel as escapes
    try:
        value = loads_object(body)
    except BadJson:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        return
    value["prompt"].encode("utf-8")
