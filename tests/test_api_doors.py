"""Three of the API's doors that did not hold, as a hostile client or web page tries them.

Real Hypercorn on loopback over a real in-process core (tests/_api_helpers.py):

* a lone surrogate (JSON ``"\\ud800"`` or the raw bytes ED A0 80) in any string a
  route reads -- chat content, prompts, system, model names, field names, option
  keys -- was a 500 (the tokenizer's TypeError, or an error message that could
  not be encoded); now a 400 naming the field, in OpenAI's error shape;
* a JSON body sent as text/plain, form or XML (what a web page may send
  cross-site without a preflight) was served; now 415 before a byte is read;
* ``Host: evil.example`` (DNS rebinding) was served; now refused. A POST from a
  foreign page (its Origin) is refused; the node's own origin, a configured
  CORS origin and clients that send no Origin are served.

The fourth door (the key on the command line) is tests/test_api_key_file.py;
the fifth (idle HTTP/2 sockets) tests/test_api_connections.py.
"""
from __future__ import annotations

import json

import httpx
import pytest

from tests._api_helpers import MODEL_ID, running_api, tiny_swarm

SURROGATE = "hi \\ud800"            # as JSON text: the escape of a lone high surrogate
RAW_SURROGATE = "hi \udcff"         # becomes the bytes ED B3 BF with surrogatepass
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with tiny_swarm(tmp_path_factory.mktemp("doors")) as (_, _, core):
        with running_api(core, allowed_hosts=("meshd.lan",), cors_origins=("https://app.example",)) as (url, _):
            yield url


def _post(url: str, path: str, body: str | bytes, content_type: str | None = "application/json", **headers):
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    if content_type is not None:
        headers["content-type"] = content_type
    return httpx.post(url + path, content=data, headers=headers, timeout=60)


def _bodies(text: str) -> list[tuple[str, str, str]]:
    """(route, JSON body text, the param the 400 must name) with ``text`` in every string the route reads."""
    chat = '[{"role": "user", "content": "%s"}]' % text
    return [
        ("/v1/chat/completions", '{"model": "%s", "messages": %s, "max_tokens": 2}' % (MODEL_ID, chat),
         "messages[0].content"),
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
                                 '"text": "%s"}]}]}' % (MODEL_ID, text), "messages[0].content[0].text"),
        ("/v1/completions", '{"model": "%s", "prompt": "%s", "max_tokens": 2}' % (MODEL_ID, text), "prompt"),
        ("/v1/completions", '{"model": "%s", "prompt": ["%s"]}' % (MODEL_ID, text), "prompt[0]"),
        ("/v1/completions", '{"model": "%s", "prompt": "x", "stop": ["%s"]}' % (MODEL_ID, text), "stop[0]"),
        ("/api/chat", '{"model": "%s", "messages": %s}' % (MODEL_ID, chat), "messages[0].content"),
        ("/api/generate", '{"model": "%s", "prompt": "%s"}' % (MODEL_ID, text), "prompt"),
        ("/api/generate", '{"model": "%s", "prompt": "x", "system": "%s"}' % (MODEL_ID, text), "system"),
        ("/v1/chat/completions", '{"model": "%s", "messages": %s}' % (text, chat.replace(text, "x")), "model"),
        ("/api/generate", '{"model": "%s", "prompt": "x"}' % text, "model"),
        ("/v1/completions", '{"model": "%s", "prompt": "x", "%s": 1}' % (MODEL_ID, text), None),
        ("/api/chat", '{"model": "%s", "messages": %s, "options": {"%s": 1}}' % (MODEL_ID, chat.replace(text, "x"),
                                                                                 text), None),
    ]


@pytest.mark.parametrize("route,body,param", _bodies(SURROGATE) + _bodies(RAW_SURROGATE))
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(api, route, body, param):
    r = _post(api, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_string" and "surrogate" in err["message"]
    if param is not None:
        assert err["param"] == param
    else:   # a key cannot be shown: its parent is named
        assert "a key of" in err["message"]


def test_error_messages_quote_a_bounded_escaped_excerpt(api):
    long_name = "é" * 5000 + "\u2028<script>"
    r = _post(api, "/v1/chat/completions", json.dumps({"model": long_name, "messages": [{"role": "user",
                                                                                          "content": "x"}]}))
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert len(message) < 600 and "\\u00e9" in message and "<script>" not in message
    r = _post(api, "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x", "k" * 100_000: 1}))
    assert r.status_code == 400 and len(r.text) < 2000


@pytest.mark.parametrize("route", GENERATION_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml",
                                          "multipart/form-data; boundary=x", "application/jsonx", None])
def test_a_json_body_of_another_type_is_refused_with_415(api, route, content_type):
    body = json.dumps({"model": MODEL_ID, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]})
    r = _post(api, route, body, content_type)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_json_with_a_charset_parameter_is_served(api):
    body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2})
    assert _post(api, "/v1/completions", body, "Application/JSON; charset=utf-8").status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil.example", "meshd.lan.evil"])
def test_a_host_this_node_does_not_answer_to_is_refused(api, host):
    for r in (httpx.get(api + "/v1/models", headers={"host": host}),
              httpx.get(api + "/meshd/status", headers={"host": host}),
              _post(api, "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "hi"}), host=host)):
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", r.text


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:9", "localhost:8080", "[::1]:8080", "10.1.2.3",
                                  "MESHD.lan:80"])
def test_ip_literals_localhost_and_configured_names_are_served(api, host):
    assert httpx.get(api + "/v1/models", headers={"host": host}).status_code == 200


def test_a_post_from_a_foreign_page_is_refused_and_the_nodes_own_origin_is_served(api):
    body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2})
    host = api.removeprefix("http://")
    foreign = _post(api, "/v1/completions", body, origin="http://evil.example")
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
    assert _post(api, "/v1/completions", body, origin="null").status_code == 403
    assert _post(api, "/v1/completions", body, origin=f"http://{host}").status_code == 200
    assert _post(api, "/v1/completions", body).status_code == 200          # SDKs send no Origin
    # a cross-site GET gets its answer without CORS headers: the browser keeps it from the page
    r = httpx.get(api + "/v1/models", headers={"origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_configured_cors_origin_gets_preflights_and_answers(api):
    body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2})
    pre = httpx.options(api + "/v1/completions", headers={
        "origin": "https://app.example", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    r = _post(api, "/v1/completions", body, origin="https://app.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(api + "/v1/completions", headers={"origin": "http://evil.example",
                                                            "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_the_dashboard_and_its_status_still_load_same_origin(api):
    page = httpx.get(api + "/")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert httpx.get(api + "/static/dashboard.js").status_code == 200
    assert httpx.get(api + "/meshd/status", headers={"referer": api + "/"}).status_code == 200
