"""The OpenAI/Ollama HTTP API end to end over a real in-process core (tests/_api_helpers.py).

The official ``openai`` client talks to Hypercorn on loopback; the answers
come from real gRPC shards of a tiny random Llama through the route driver,
and the greedy text equals the whole model's. Bad fields get 400s in
OpenAI's error shape; disconnecting frees the KV on every shard; the
entry's limits give 429 and 504; a missing tail gives 503 with Retry-After.
"""
from __future__ import annotations

import functools
import json

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from meshd.api.entry import EntryLimits
from meshd.generate.tokenizer import EntryTokenizer
from meshd.testing.models import build_random_llama
from shard.model.reference import WholeModel
from tests._api_helpers import MODEL_ID, InProcessCore, chat_tokenizer_dir, running_api
from tests._swarm_helpers import start_shard
from tests.conftest import wait_until_blocking

PROMPT = "The quick brown fox"
KEY = "k" * 24


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_random_llama(seed=3)


@pytest.fixture(scope="module")
def shards(model):
    made = [start_shard(model, "peer-a", 0, 3), start_shard(model, "peer-b", 3, 6)]
    yield made
    for s in made:
        s.kill()


@pytest.fixture(scope="module")
def tokenizer(model, tmp_path_factory):
    return EntryTokenizer(chat_tokenizer_dir(model, tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def core(shards, tokenizer, model):
    return InProcessCore(shards, tokenizer, model)


@pytest.fixture(scope="module")
def api(core):
    with running_api(core) as (url, entry):
        yield url, entry


@pytest.fixture(scope="module")
def whole(model):
    return WholeModel(model)


@functools.cache
def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def reference_text(whole, tokenizer, ids: list[int], n: int) -> tuple[str, int]:
    tokens = whole.generate(ids, n).tokens
    cut = next((i for i, t in enumerate(tokens) if t in tokenizer.stop_ids), None)
    tokens = tokens if cut is None else tokens[:cut + 1]
    return tokenizer.decode(tokens), len(tokens)


def wait_idle(shards) -> None:
    """Every shard's sessions freed (the driver releases them as the request ends)."""
    wait_until_blocking(lambda: all(s.active_sessions() == 0 for s in shards), 2.0, "every shard without sessions")


def test_models_lists_the_swarm_model(api):
    url, _ = api
    (m,) = client(url).models.list().data
    assert m.id == MODEL_ID and m.owned_by == "meshd"


def test_completion_equals_the_whole_model_and_counts_usage(api, whole, tokenizer, shards):
    url, _ = api
    out = client(url).completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12)
    text, n = reference_text(whole, tokenizer, tokenizer.encode_prompt(PROMPT, raw=True), 12)
    assert out.choices[0].text == text
    assert out.usage.completion_tokens == n
    assert out.usage.prompt_tokens == len(tokenizer.encode_prompt(PROMPT, raw=True))
    assert out.choices[0].finish_reason == ("length" if n == 12 else "stop")
    wait_idle(shards)


def test_chat_streaming_and_not_give_the_same_text_and_usage_equals_streamed_tokens(api, whole, tokenizer, shards):
    url, _ = api
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello world!"}]
    c = client(url)
    whole_answer = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=10)
    chunks = list(c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))
    token_chunks = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason is None]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    text, n = reference_text(whole, tokenizer, tokenizer.encode_chat([("system", "be brief"),
                                                                      ("user", "Hello world!")]), 10)
    assert streamed == whole_answer.choices[0].message.content == text
    assert token_chunks[0].choices[0].delta.role == "assistant"
    assert len(token_chunks) == chunks[-1].usage.completion_tokens == whole_answer.usage.completion_tokens == n
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason in ("stop", "length")
    wait_idle(shards)


def test_stop_strings_are_cut_even_across_tokens(api, whole, tokenizer):
    url, _ = api
    text, _ = reference_text(whole, tokenizer, tokenizer.encode_prompt(PROMPT, raw=True), 16)
    ids = tokenizer._tok.encode(text).ids
    assert len(ids) >= 6
    at = len(tokenizer.decode(ids[:3]))          # a stop string that starts inside the 3rd token's text
    stop = text[at - 1:at + 3]
    assert len(stop) == 4 and stop in text
    c = client(url)
    out = c.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=16, stop=[stop, "\x00never"])
    assert out.choices[0].text == text[:text.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=16, stop=stop, stream=True) if ch.choices)
    assert streamed == text[:text.index(stop)]


def test_seeded_sampling_is_reproducible(api):
    url, _ = api
    c = client(url)
    runs = [c.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9,
                                 seed=seed).choices[0].text for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


BAD_FIELDS = [
    ("temperature", {"temperature": 3}), ("top_p", {"top_p": 0}), ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 10**9}), ("n", {"n": 2}), ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("top_logprobs", {"top_logprobs": 3}), ("stop", {"stop": ["a", "b", "c", "d", "e"]}), ("stop", {"stop": 3}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("response_format", {"response_format": {"type": "json_object"}}), ("presence_penalty", {"presence_penalty": 1}),
    ("seed", {"seed": "x"}), ("messages", {"messages": []}), ("messages[0].role", {"messages": [{"role": "tool",
                                                                                               "content": "x"}]}),
    ("messages[0].content", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("stream_options", {"stream_options": {"include_usage": True}}), ("frobnicate", {"frobnicate": 1}),
]


@pytest.mark.parametrize("param,fields", BAD_FIELDS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_FIELDS)])
def test_each_bad_field_gets_a_400_in_openai_shape(api, param, fields):
    url, _ = api
    with pytest.raises(openai.BadRequestError) as info:   # extra_body: the server checks, not the client
        client(url).chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                            extra_body=fields)
    err = info.value.body
    assert info.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_malformed_bodies_get_400_413_and_the_server_keeps_serving(api):
    url, _ = api
    deep = b'{"model": "x", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert len(deep) < 2100
    with httpx.Client(base_url=url, timeout=30) as h:
        for body, status in ((deep, 400), (b'{"model": NaN}', 400), (b"not json", 400), (b"[1]", 400),
                             (b'{"a": "' + b"x" * (2 << 20) + b'"}', 413)):
            r = h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = h.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert h.get("/v1/nope").status_code == 404 and "error" in h.get("/v1/nope").json()
        assert h.get("/v1/models").status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_every_shard(api, shards):
    url, entry = api
    with httpx.Client(base_url=url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4000,
                                                        "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert any(s.active_sessions() for s in shards)
    wait_idle(shards)
    wait_until_blocking(lambda: entry.running == 0, 2.0, "the entry's running count back to 0")


def test_busy_entry_answers_429_with_retry_after(core, shards):
    with running_api(core, limits=EntryLimits(max_running=1, max_deferred=0)) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as h:
            with h.stream("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4000,
                                                            "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()   # keep it: a dropped iterator closes the connection (httpcore)
                next(lines)
                with pytest.raises(openai.RateLimitError) as info:
                    client(url).completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2)
                assert info.value.response.headers["retry-after"] == "2"
    wait_idle(shards)


def test_a_full_swarm_answers_429_with_the_workers_retry_hint(api, shards):
    from shard.session.sessions import Owner, SessionKey

    url, _ = api
    m, hog = shards[1].service.manager, SessionKey("hog", 0)
    with shards[1].service.lock:   # another peer's session takes the tail's whole KV budget
        m.open(hog, m.policy.kv_budget_tokens, Owner.of("noise:hog", b"h" * 32))
    try:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "swarm_full", r.text
        assert int(r.headers["retry-after"]) >= 1
    finally:
        with shards[1].service.lock:
            m.release(hog, Owner.of("noise:hog", b"h" * 32))
    wait_idle(shards)


def test_generation_deadline_gives_504_and_frees_the_kv(core, shards):
    with running_api(core, limits=EntryLimits(deadline_s=0.5)) as (url, _):
        with pytest.raises(openai.APIStatusError) as info:
            client(url).completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4000)
        assert info.value.status_code == 504 and info.value.body["code"] == "generation_deadline"
    wait_idle(shards)


def test_no_route_gives_503_with_retry_after(shards, tokenizer):
    head_only = InProcessCore(shards[:1], tokenizer)   # nobody serves layers 3:6
    with running_api(head_only) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_ID, "prompt": PROMPT}, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "no_route"


def test_api_key_is_required_everywhere_but_the_page(core):
    with running_api(core, key=KEY) as (url, _):
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong-key-wrong-key-wrong").models.list()
        assert client(url, KEY).models.list().data[0].id == MODEL_ID
        for path in ("/metrics", "/meshd/status", "/api/tags"):
            r = httpx.get(url + path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
        assert httpx.get(url + "/static/dashboard.js").status_code == 200


def test_metrics_parse_and_move_with_a_generation(api):
    url, _ = api

    def scrape() -> dict:
        text = httpx.get(f"{url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    before = scrape()
    out = client(url).completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=8)
    after = scrape()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("meshd_tokens_predicted_total") == out.usage.completion_tokens
    assert delta("meshd_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("meshd_requests_total", edge="http", outcome="ok") == 1
    assert delta("meshd_hop_sessions_total", transport="direct") == 2
    steps = sum(v for (name, labels), v in after.items() if name == "meshd_hop_step_seconds_count") - \
        sum(v for (name, labels), v in before.items() if name == "meshd_hop_step_seconds_count")
    assert steps == 2 * (out.usage.completion_tokens - 1)   # every decode step, on both hops
    assert delta("meshd_hop_bytes_total", peer="peer-b", transport="direct", direction="received") > 0
    assert after[("meshd_requests_processing", ())] == 0


def test_ollama_routes_over_the_same_core(api, whole, tokenizer):
    url, _ = api
    text, n = reference_text(whole, tokenizer, tokenizer.encode_prompt(PROMPT, raw=True), 8)
    with httpx.Client(base_url=url, timeout=60) as h:
        assert h.get("/api/tags").json()["models"][0]["name"] == MODEL_ID
        one = h.post("/api/generate", json={"model": MODEL_ID, "prompt": PROMPT, "raw": True, "stream": False,
                                            "options": {"num_predict": 8}}).json()
        assert one["response"] == text and one["done"] and one["eval_count"] == n
        with h.stream("POST", "/api/chat", json={"model": MODEL_ID, "options": {"num_predict": 6},
                                                 "messages": [{"role": "user", "content": "hi"}]}) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert lines[-1]["done"] and lines[-1]["done_reason"] in ("stop", "length")
        assert len(lines) - 1 == lines[-1]["eval_count"]
        r = h.post("/api/chat", json={"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}],
                                      "options": {"mirostat": 2}})
        assert r.status_code == 400


def test_logprobs_come_back_from_the_driver(api):
    """The tail samples and reports each token's logprob and the top alternatives (SampledToken)."""
    url, _ = api
    c = client(url)
    out = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6   # greedy: the chosen token is the most likely


def test_oversized_headers_are_refused_and_silent_sockets_cannot_hold_every_slot(core):
    import socket as so

    with running_api(core) as (url, _):     # tests/_api_helpers.py serves at most 8 connections
        r = httpx.get(f"{url}/v1/models", headers={"x-big": "a" * 20_000})
        assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
        host, port = url.removeprefix("http://").split(":")
        held = [so.create_connection((host, int(port))) for _ in range(8)]
        try:   # every slot taken by sockets that sent nothing: a newcomer gets the oldest one's slot
            assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 200
        finally:
            for s in held:
                s.close()
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
