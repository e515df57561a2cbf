"""The API's request parsers and config, pure: any JSON body gives params or a typed 400/404, never a crash."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.api import ollama, openai
from meshd.api.errors import ApiError, api_error
from meshd.config import load_config
from meshd.errors import ConfigError
from meshd.generate.params import GenerateParams

MODEL = "m"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)
FIELDS = sorted(openai.CHAT_FIELDS | openai.COMPLETION_FIELDS | ollama.CHAT_FIELDS | ollama.GENERATE_FIELDS
                | {"options"})
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=8)


def _some_valid(body: dict, key: str, value) -> dict:
    return {**body, "model": MODEL, key: value}


@settings(max_examples=120, deadline=None)
@given(body=bodies, messages=st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", 3]), "content": json_values}), max_size=3))
@pytest.mark.parametrize("parse", [openai.parse_chat, ollama.parse_chat])
def test_chat_parsers_give_params_or_a_typed_error(parse, body, messages):
    try:
        out = parse(_some_valid(body, "messages", messages), MODEL)
    except ApiError as exc:
        assert exc.status in (400, 404) and exc.body()["error"]["message"]
        return
    assert isinstance(out[0], GenerateParams)


@settings(max_examples=120, deadline=None)
@given(body=bodies, prompt=json_values | st.text(max_size=20))
@pytest.mark.parametrize("parse", [openai.parse_completion, ollama.parse_generate])
def test_prompt_parsers_give_params_or_a_typed_error(parse, body, prompt):
    try:
        out = parse(_some_valid(body, "prompt", prompt), MODEL)
    except ApiError as exc:
        assert exc.status in (400, 404)
        return
    assert isinstance(out[0], GenerateParams)


def test_a_good_chat_body_maps_every_field():
    params, answer = openai.parse_chat({
        "model": MODEL, "messages": [{"role": "developer", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n", "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 4, "n": 1, "user": "u",
        "tool_choice": "none", "response_format": {"type": "text"}}, MODEL)
    assert params.messages == (("system", "be brief"), ("user", "hi")) and params.max_tokens == 7
    assert (params.temperature, params.top_p, params.seed, params.stop) == (0.5, 0.9, 3, ("\n",))
    assert params.logprobs and params.top_logprobs == 4
    assert answer == openai.Answer(MODEL, stream=True, include_usage=True, logprobs=4)


def test_core_errors_map_to_statuses():
    from meshd.api.errors import Busy, GenerationDeadline
    from meshd.generate.driver import RouteFailed
    from meshd.generate.service import NotReady
    from proto.errors import LocalError

    assert [api_error(e).status for e in (LocalError("x"), NotReady("x"), RouteFailed("x"), Busy("x", 2),
                                          GenerationDeadline("x"), RuntimeError("x"))] == [400, 503, 503, 429, 504, 500]
    assert api_error(NotReady("x")).headers() == {"retry-after": "5"}


def test_api_config_from_toml_flags_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text('model = "/m"\nlayers = "0:2"\n[api]\nlisten = "0.0.0.0:9000"\nkey = "a-long-enough-key-1"\n'
                    "max_running = 2\n")
    config = load_config(path)
    assert config.api.bind == ("0.0.0.0", 9000) and config.api.max_running == 2 and config.api.explicit
    assert load_config(path, {"api.listen": "off"}).api.bind is None
    path.write_text('model = "/m"\nlayers = "0:2"\n[api]\nlisten = "[::]:9000"\n')
    with pytest.raises(ConfigError, match="needs a bearer key"):
        load_config(path)
    monkeypatch.setenv("MESHD_API_KEY", "k" * 20)
    assert load_config(path).api.key == "k" * 20
    path.write_text('model = "/m"\nlayers = "0:2"\n[api]\nport = 1\n')
    with pytest.raises(ConfigError, match="api.port"):
        load_config(path)
    monkeypatch.delenv("MESHD_API_KEY")
    default = load_config(None, {"model": "/m", "layers": (0, 2)}).api
    assert default.bind == ("127.0.0.1", 8080) and not default.explicit and default.key is None
