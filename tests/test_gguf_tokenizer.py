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
    from shard.backend import LayerRange

    os.environ["MESHD_SLICE_CACHE"] = str(tmp_path)
    try:
        no_vocab = slice_path(smollm2_gguf_path(), LayerRange(0, 30, 30), progress=None)
    finally:
        del os.environ["MESHD_SLICE_CACHE"]
    with pytest.raises(ConfigError, match="cannot tokenize"):
        EntryTokenizer(no_vocab)
