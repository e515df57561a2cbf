"""TextStream: incremental text equals a full decode; stop strings never leak, across token boundaries."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.generate.params import GenerateParams
from meshd.generate.textstream import TextStream
from proto.errors import LocalError


@pytest.fixture(scope="module")
def tok():
    from meshd.generate.tokenizer import EntryTokenizer
    from meshd.testing.models import build_random_llama

    return EntryTokenizer(build_random_llama(seed=3))


def _run(decode, ids, stops):
    ts = TextStream(decode, stops)
    out = "".join(ts.push(i) for i in ids if not ts.stopped)
    return out + ts.finish(), ts.stopped


def _reference(decode, ids, stops):
    """Brute force: decode every prefix; the first prefix holding a stop string ends the text."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if text.endswith("\ufffd"):
            continue
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], True
    return decode(ids), False


def test_stop_string_spanning_tokens_is_cut_and_never_sent(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok._tok.encode(text).ids
    assert len(ids) > 5
    ts = TextStream(tok.decode, ["fox jumps"])
    sent = []
    for i in ids:
        sent.append(ts.push(i))
        if ts.stopped:
            break
    assert "".join(sent) + ts.finish() == "The quick brown "
    assert not any("fox" in piece for piece in sent)   # not even a part of the stop string went out
    assert ts.stopped


def test_text_that_only_looks_like_a_stop_is_released(tok):
    ids = tok._tok.encode("Hello world! meshd pools").ids
    assert _run(tok.decode, ids, ["world?"]) == ("Hello world! meshd pools", False)
    assert _run(tok.decode, ids, []) == ("Hello world! meshd pools", False)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(4, 383), min_size=1, max_size=24),
       stops=st.lists(st.text(alphabet="abcdefo ehlrtw.!", min_size=1, max_size=4), max_size=4))
def test_streamed_text_equals_the_reference_for_any_tokens_and_stops(tok, ids, stops):
    assert _run(tok.decode, ids, stops) == _reference(tok.decode, ids, stops)


def test_multibyte_characters_wait_for_their_last_byte(tok):
    ids = tok._tok.encode("é ü").ids   # byte-level BPE: these characters are split across byte tokens
    ts = TextStream(tok.decode, [])
    pieces = [ts.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) + ts.finish() == "é ü"


@pytest.mark.parametrize("bad", [
    {"prompt": "x", "stop": ["a"] * 5}, {"prompt": "x", "stop": [""]}, {"prompt": "x", "stop": [3]},
    {"prompt": "x", "top_logprobs": 21, "logprobs": True}, {"prompt": "x", "top_logprobs": 2},
    {"messages": [{"role": "tool", "content": "x"}]}, {"messages": []}, {"prompt": "x", "messages": []},
    {"prompt": "x", "temperature": 2.5}, {"prompt": "x", "top_p": 0}, {"prompt": "x", "seed": 2**64},
])
def test_params_refuse_bad_fields(bad):
    with pytest.raises(LocalError):
        GenerateParams.from_request(bad)


def test_params_accept_a_chat_and_stops():
    p = GenerateParams.from_request({"messages": [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hi"}], "stop": "\n"})
    assert p.messages == (("system", "be brief"), ("user", "hi")) and p.stop == ("\n",)
    assert GenerateParams.from_request({"prompt": "x", "seed": -1}).sampling().seed == 2**64 - 1
