"""The entry's tokenizer for a ``.gguf``: built from the file's own metadata, without transformers.

A GGUF has no tokenizer.json; it stores the vocabulary (``tokenizer.ggml.tokens``),
token types, merges (or, for SentencePiece vocabularies, scores), the special
ids and the chat template as metadata. ``gguf_tokenizer(path)`` reads them
with the bounded reader (native/gguf_file.py) and assembles the same
``tokenizers.Tokenizer`` transformers' GGUF loader builds (verified id for id
on SmolLM2 and Gemma 3 by tests/test_gguf_tokenizer.py), in ~1/10 of its time:

    tokenizer.ggml.model = "gpt2"    byte-level BPE: tokens respelled in the
                                     byte alphabet, the file's merges, GPT-2's
                                     ByteLevel split (or the pre-tokenizer regex
                                     ``tokenizer.ggml.pre`` names), ByteLevel decoder
    "llama" + arch gemma/gemma2/3    SentencePiece BPE with byte fallback: runs of
                                     spaces respelled as U+2581, merges derived from
                                     the vocabulary in file order (Gemma's scores do
                                     not follow its merge order), " " -> U+2581

Control tokens (type 3) become special added tokens, user-defined ones (4)
plain added tokens, and ``tokenizer.ggml.add_bos_token`` a BOS template.
Anything else is refused with a ConfigError naming the type.

State: none; the result is an immutable ``TokenizerParts`` for EntryTokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from meshd.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# llama.cpp's token types (llama_token_type / gguf TokenType).
CONTROL, USER_DEFINED = 3, 4
# Pre-tokenizer regexes by ``tokenizer.ggml.pre`` (the split a BPE vocabulary was learned with).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                        "deepseek-r1-qwen": _QWEN2_SPLIT}
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
SPIECE_SPACE = "\u2581"


@dataclass(frozen=True, slots=True)
class TokenizerParts:
    tokenizer: Tokenizer
    chat_template: str | None
    special: dict[str, str]        # bos_token, eos_token, ... for the template
    stop_ids: frozenset[int]


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def _derived_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary, best first: a token ranks by its position in the file."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, index in vocab.items():
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        merges.extend((index, len(left), len(right), left, right) for _, _, left, right in local)
    # Best first: earlier tokens first, then the longer left piece, then the longer right piece
    # (the order transformers' generate_merges gives; the sort is stable for the rest).
    merges.sort(key=lambda m: (m[0], -m[1], -m[2]))
    return [(m[3], m[4]) for m in merges]


def _tokens(reader, key: str) -> list:
    value = reader.value(key)
    if not isinstance(value, list):
        raise ConfigError(f"GGUF metadata {key} is missing or not an array: the entry cannot tokenize")
    return value


def gguf_tokenizer(path: Path) -> TokenizerParts:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    from native.errors import ArtifactError
    from native.gguf_range import open_reader

    try:
        reader = open_reader(path)
    except ArtifactError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    kind = reader.value("tokenizer.ggml.model")
    arch = reader.value("general.architecture")
    tokens = raw_tokens = _tokens(reader, "tokenizer.ggml.tokens")
    types = reader.value("tokenizer.ggml.token_type") or []
    if not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"{path.name}: tokenizer.ggml.tokens holds non-strings")
    if kind == "gpt2":
        spelling = _byte_alphabet()
        alphabet = set(spelling.values())
        vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in _tokens(reader, "tokenizer.ggml.merges")]
        if any(len(m) != 2 for m in merges):
            raise ConfigError(f"{path.name}: a tokenizer.ggml.merges entry is not 'left right'")
        tok = Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False))
        split = PRE_TOKENIZER_SPLITS.get(reader.value("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        control_ok = alphabet
        add_bos_default = False
    elif kind == "llama" and arch in GEMMA_ARCHITECTURES:
        tokens = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        listed = reader.value("tokenizer.ggml.merges")
        pairs = [tuple(m.split(" ", 1)) for m in listed] if isinstance(listed, list) else _derived_merges(tokens)
        unk_id = reader.value("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else "<unk>"
        tok = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        control_ok = None
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    else:
        raise ConfigError(f"{path.name}: the entry cannot build a tokenizer of type {kind!r} for architecture "
                          f"{arch!r} (supported: gpt2 byte-level BPE, Gemma SentencePiece)")
    kinds = list(types)[:len(tokens)] if isinstance(types, list) else []
    # Added tokens keep the file's spelling; a user-defined one the vocabulary respelled is not added.
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(raw_tokens, kinds)
               if k == CONTROL and (control_ok is None or set(t) <= control_ok)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(raw_tokens, kinds)
            if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    special: dict[str, str] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = reader.value(f"tokenizer.ggml.{key}")
        if isinstance(index, int) and 0 <= index < len(tokens):
            special[name] = tokens[index]
    add_bos = reader.value("tokenizer.ggml.add_bos_token")
    if (add_bos if isinstance(add_bos, bool) else add_bos_default) and "bos_token" in special:
        bos = special["bos_token"]
        tok.add_special_tokens([AddedToken(bos, normalized=False, special=True)])
        bos_id = vocab.get(bos, tok.token_to_id(bos))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    stops = {reader.value(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")}
    template = reader.value("tokenizer.chat_template")
    return TokenizerParts(tok, template if isinstance(template, str) else None, special,
                          frozenset(s for s in stops if isinstance(s, int) and 0 <= s < len(tokens)))
