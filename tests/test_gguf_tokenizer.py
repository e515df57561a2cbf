"""The entry's GGUF tokenizer (built from the file's metadata) gives transformers' GGUF ids.

transformers' ``AutoTokenizer.from_pretrained(..., gguf_file=)`` is the
reference; texts cover spaces, tabs, newlines, non-ASCII, emoji, chat
markers (special tokens inside text) and long runs.
"""
from __future__ import annotations

import os

import pytest

from meshd.generate.tokenizer import EntryTokenizer
from meshd.testing.models import gemma3_gguf_path, smollm2_gguf_path

TEXTS = ["Hello world!", "  leading spaces and\ttabs\n\nnewlines", "The capital of France is Paris.",
         "ünïcödé 日本語 emoji 🎉", "<start_of_turn>user\nhi<end_of_turn>", "<|im_start|>user\nWhat?<|im_end|>",
         "numbers 1234567 and code: def f(x): return x**2", "   ", "a" * 300, "don't you'll I'M"]


def _reference(path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _compare(path):
    ours, ref = EntryTokenizer(path), _reference(path)
    for text in TEXTS:
        for special in (True, False):
            assert ours._tok.encode(text, add_special_tokens=special).ids == \
                ref(text, add_special_tokens=special)["input_ids"], (text, special)
        ids = ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    return ours, ref


# transformers 5.23's ids for SmolLM2's GGUF tokenizer (AutoTokenizer, gguf_file=), recorded once:
# the default suite checks these; the slow test below compares against transformers live.
SMOL_GOLDEN = {
    "Hello world!": [19556, 905, 17],
    "  leading spaces and\ttabs\n\nnewlines": [216, 2899, 5600, 284, 197, 100, 7366, 198, 198, 2241, 5110],
    "ünïcödé 日本語 emoji 🎉": [47682, 25972, 83, 7466, 84, 2756, 17097, 241, 115, 40993, 179, 120, 248, 649,
                            33777, 15107, 232, 227],
    "<|im_start|>user\nWhat?<|im_end|>": [1, 4093, 198, 1780, 47, 2],
}
SMOL_CHAT_HI = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                19712, 8182, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]


def test_smollm2_golden_ids_and_chat_template():
    ours = EntryTokenizer(smollm2_gguf_path())
    for text, ids in SMOL_GOLDEN.items():
        assert ours.encode_prompt(text, raw=True) == ids, text
        assert ours.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert ours.encode_prompt("Hi", raw=False) == SMOL_CHAT_HI
    assert ours.stop_ids == {2}


@pytest.mark.slow  # transformers' GGUF tokenizer takes 10-60 s to build here
def test_smollm2_ids_and_chat_template_match_transformers():
    ours, ref = _compare(smollm2_gguf_path())
    prompt = "What is the capital of France?"
    expected = ref.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else list(expected)
    assert ours.encode_prompt(prompt, raw=False) == list(expected)
    assert ours.stop_ids == {ref.eos_token_id}


@pytest.mark.slow  # transformers builds Gemma's 262k-token tokenizer in ~40 s
def test_gemma3_ids_match_transformers():
    ours, ref = _compare(gemma3_gguf_path())
    assert ours.chat_template is None  # the file has none: prompts are encoded raw, with <bos>
    assert ours.encode_prompt("hi", raw=False)[0] == ref.bos_token_id
    assert ours.stop_ids == {ref.eos_token_id}


def test_gguf_without_vocabulary_is_a_config_error(tmp_path):
    from meshd.errors import ConfigError
    from native.slice import slice_path
    from shard.model.backend import LayerRange

    os.environ["MESHD_SLICE_CACHE"] = str(tmp_path)
    try:
        no_vocab = slice_path(smollm2_gguf_path(), LayerRange(0, 30, 30), progress=None)
    finally:
        del os.environ["MESHD_SLICE_CACHE"]
    with pytest.raises(ConfigError, match="cannot tokenize"):
        EntryTokenizer(no_vocab)


def test_a_lone_surrogate_is_the_clients_error_not_a_type_error():
    """The tokenizers library raises TypeError on a lone surrogate (it was an HTTP 500): now LocalError."""
    from proto.errors import LocalError

    tok = EntryTokenizer(smollm2_gguf_path())
    for call in (lambda: tok.encode_chat([("user", "hi \ud800")]), lambda: tok.encode_prompt("x \udfff", raw=True),
                 lambda: tok.encode_prompt("x \udfff", raw=False)):
        with pytest.raises(LocalError, match="lone surrogate"):
            call()
    assert tok.encode_prompt("hi \U0001F600", raw=True)
