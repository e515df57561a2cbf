"""The entry node's tokenizer: the artifact's tokenizer.json (or a GGUF's metadata), without transformers.

The daemon must stay light (transformers pulls in torch: seconds of CPU and
hundreds of MB per daemon), so the entry uses the ``tokenizers`` library on
the artifact's ``tokenizer.json`` directly, and renders the chat template
(``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``)
with a sandboxed jinja2 environment, as transformers does:

    chat     render([{"role": "user", "content": prompt}], add_generation_prompt)
             -> encode(text, add_special_tokens=False)
    messages render([{"role": r, "content": c}, ...], add_generation_prompt) (the API's chat);
             a template's raise_exception() and render errors are the client's LocalError
    raw      encode(prompt)                 (the tokenizer's own post-processor)
    stops    eos_token of tokenizer_config.json + the eos ids of generation_config.json

A ``.gguf`` model brings its tokenizer in its metadata; gguf_tokenizer.py
builds it (same ids as transformers' GGUF loader) and the same template
rendering applies.

State: the loaded tokenizer and template; immutable after load.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from meshd.errors import ConfigError
from proto.errors import LocalError

# Config files of a tokenizer are small; refuse anything absurd.
MAX_CONFIG_BYTES = 4 << 20


def _json(path: Path) -> dict:
    if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _scalar(text: str, what: str) -> None:
    """The tokenizers library takes only Unicode scalar values: a lone surrogate is the client's error
    (a LocalError here, not its TypeError). The HTTP API refuses such strings earlier, naming the field."""
    if not isinstance(text, str):
        raise LocalError(f"{what} must be a string")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise LocalError(f"{what} holds a lone surrogate (U+D800..U+DFFF) at character {exc.start}: "
                             "text must be valid Unicode") from exc


class EntryTokenizer:
    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        if Path(model_dir).is_file():  # a .gguf: the tokenizer and template are in its metadata
            from meshd.generate.gguf_tokenizer import gguf_tokenizer

            parts = gguf_tokenizer(Path(model_dir))
            self._tok, self.chat_template = parts.tokenizer, parts.chat_template
            self._special, self.stop_ids = parts.special, parts.stop_ids
            return
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} has no tokenizer.json: the entry node cannot tokenize prompts")
        self._tok = Tokenizer.from_file(str(path))
        config = _json(Path(model_dir) / "tokenizer_config.json")
        template_file = Path(model_dir) / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        self._special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        stops: set[int] = set()
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and (eos_id := self._tok.token_to_id(eos)) is not None:
            stops.add(eos_id)
        gen_eos = _json(Path(model_dir) / "generation_config.json").get("eos_token_id")
        for value in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(value, int):
                stops.add(value)
        self.stop_ids = frozenset(stops)

    def encode_prompt(self, prompt: str, raw: bool) -> list[int]:
        _scalar(prompt, "the prompt")
        if raw or not self.chat_template:
            return list(self._tok.encode(prompt).ids)
        return self.encode_chat([("user", prompt)])

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Chat messages (role, text) through the model's chat template, ready for a reply."""
        if not self.chat_template:
            raise LocalError("this model has no chat template: send a plain prompt instead "
                             "(/v1/completions, or raw)")
        for i, (_, content) in enumerate(messages):
            _scalar(content, f"message {i}")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise LocalError(f"the model's chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            text = env.from_string(self.chat_template).render(
                messages=[{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=True, **self._special)
        except TemplateError as exc:
            raise LocalError(f"the model's chat template failed on these messages: {exc}") from exc
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def piece(self, token_id: int) -> str:
        """One token's own text (logprobs); special tokens are shown, not skipped."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
