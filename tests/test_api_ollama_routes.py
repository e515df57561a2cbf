"""The Ollama routes clients call, with the official ``ollama`` client (and ``openai`` for /v1/embeddings).

Real Hypercorn over a real in-process core: two gRPC shards of a tiny random
Llama (tests/_api_helpers.py). ``show`` reports what the artifact's files say
(family, parameter count, quantization, context, template); ``list`` the real
size and a ``sha256:`` digest; ``ps`` the model loaded; ``embed`` the
mean-pooled last hidden state through the split route -- equal to the whole
model's (transformers, same weights, fp32) up to float rounding, and the same
whatever the split.
"""
from __future__ import annotations

import numpy as np
import ollama
import openai
import pytest
import torch

from tests._api_helpers import MODEL_ID, running_api, tiny_swarm


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_swarm(tmp_path_factory.mktemp("ollama")) as (model, _, core):
        with running_api(core) as (url, _):
            yield url, model, core


def _whole_model_embedding(model_dir, ids: list[int]) -> np.ndarray:
    from transformers import AutoModel

    m = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = m(torch.tensor([ids])).last_hidden_state[0]
    return hidden.double().mean(dim=0).numpy()


def test_show_tells_family_parameters_quantization_context_and_template(served):
    url, _, _ = served
    info = ollama.Client(host=url).show(MODEL_ID)
    assert info.details.family == "llama" and info.details.format == "safetensors"
    assert info.details.quantization_level == "F32" and info.details.parameter_size
    assert info.modelinfo["general.parameter_count"] > 100_000 and info.modelinfo["llama.context_length"] > 0
    assert info.template == "" and "embedding" in info.capabilities    # this random model has no template


def test_the_card_of_a_real_gguf():
    from meshd.api.model_card import ModelCard
    from native.packaged import smollm2_gguf_path

    card = ModelCard.read(smollm2_gguf_path(), "smollm2", "sha256:" + "0" * 64)
    assert (card.family, card.parameter_size, card.quantization_level, card.context_length) == \
        ("llama", "135M", "Q4_1", 8192)
    assert "<|im_start|>" in card.template and card.size_bytes == smollm2_gguf_path().stat().st_size
    assert card.model_info["llama.block_count"] == 30 and "tokenizer.ggml.tokens" not in card.model_info


def test_list_gives_real_size_family_and_a_sha256_digest(served):
    url, model, _ = served
    (m,) = ollama.Client(host=url).list().models
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    assert m.model == MODEL_ID and m.size == weights > 0
    assert m.digest.startswith("sha256:") and len(m.digest) == 71
    assert m.details.family == "llama" and m.details.parameter_size


def test_ps_lists_the_model_loaded_on_the_swarm(served):
    url, _, _ = served
    (m,) = ollama.Client(host=url).ps().models
    assert m.model == MODEL_ID and m.size > 0 and m.digest.startswith("sha256:") and m.context_length > 0


def test_embed_is_the_mean_pooled_last_hidden_state_of_the_whole_model(served):
    url, model, core = served
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    out = ollama.Client(host=url).embed(model=MODEL_ID, input=texts)
    assert len(out.embeddings) == 2 and out.prompt_eval_count > 0
    for text, got in zip(texts, out.embeddings):
        want = _whole_model_embedding(model, core.tokenizer.encode_prompt(text, raw=True))
        want = want / np.linalg.norm(want)
        assert len(got) == want.shape[0]
        assert np.allclose(got, want, atol=1e-5), np.abs(np.array(got) - want).max()
        assert abs(np.linalg.norm(got) - 1.0) < 1e-6
    legacy = ollama.Client(host=url).embeddings(model=MODEL_ID, prompt=texts[0]).embedding
    raw = _whole_model_embedding(model, core.tokenizer.encode_prompt(texts[0], raw=True))
    assert np.allclose(legacy, raw, atol=1e-4)


def test_openai_embeddings_match_ollamas(served):
    url, _, _ = served
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = c.embeddings.create(model=MODEL_ID, input=["The quick brown fox"])
    same = ollama.Client(host=url).embed(model=MODEL_ID, input="The quick brown fox").embeddings[0]
    assert np.allclose(out.data[0].embedding, same, atol=1e-6) and out.usage.prompt_tokens > 0   # float32 on the wire
    floats = c.embeddings.create(model=MODEL_ID, input="The quick brown fox", encoding_format="float")
    assert np.allclose(floats.data[0].embedding, same, atol=1e-12)


def test_embeddings_leave_no_session_and_refuse_what_they_cannot_do(served):
    url, _, core = served
    assert all(s.active_sessions() == 0 for s in core.shards)
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=url).embed(model=MODEL_ID, input="x", dimensions=8)
    assert info.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=url).show("some-other-model")
    assert info.value.status_code == 404
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model=MODEL_ID, input=[[1, 2, 3]])


def test_workers_report_their_machine_and_recent_steps_in_health(served):
    url, _, core = served
    ollama.Client(host=url).embed(model=MODEL_ID, input="warm the route up")
    for shard in core.shards:
        h = shard.service.health()
        assert h.cpu_cores >= 1 and h.machine_memory_bytes > h.resident_bytes > 0
        assert h.prefill_positions > 0 and h.recent_prefill_tokens_per_s > 0
