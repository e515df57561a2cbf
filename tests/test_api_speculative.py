"""Speculative decoding behind the HTTP API: same text, drafted/accepted tokens in usage and /metrics.

The in-process core of tests/_api_helpers.py with a SpeculativeDriver
(prompt lookup, k pinned to 3) over two real gRPC shards of the tiny Llama:
the greedy text equals the whole model's, the OpenAI ``usage`` carries
``completion_tokens_details`` (accepted / rejected prediction tokens, OpenAI's
names for them), and the /metrics counters move by the same numbers.
"""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd.generate.draft import FixedDraftLength, PromptLookup
from meshd.generate.hop_meter import MeteredConnector
from meshd.generate.routes import AdsRouteSource, PeerConnector
from meshd.generate.speculative import SpeculativeDriver
from meshd.generate.tokenizer import EntryTokenizer
from shard.model.reference import WholeModel
from tests._api_helpers import MODEL_ID, InProcessCore, chat_tokenizer_dir, running_api
from tests._swarm_helpers import NUM_LAYERS, start_shard

PROMPT = "one two three four one two three four one two three four one two"
NEW_TOKENS = 16


class SpeculativeCore(InProcessCore):
    def driver(self, observer=None) -> SpeculativeDriver:
        fp = self.shards[0].service.backend.fingerprint
        source = AdsRouteSource(lambda: [s.ad(NUM_LAYERS) for s in self.shards], fp.model_artifact_digest,
                                NUM_LAYERS, entry_peer_id="entry", recipe_digest=fp.runtime_recipe_digest)
        connector = PeerConnector(insecure_loopback=True)
        return SpeculativeDriver(source, MeteredConnector(connector, observer) if observer else connector,
                                 fingerprint=fp, replan_wait_s=0.0, drafter=PromptLookup(),
                                 policy=FixedDraftLength(3))


@pytest.fixture(scope="module")
def api(model, tmp_path_factory):
    shards = [start_shard(model, "peer-a", 0, 3), start_shard(model, "peer-b", 3, 6)]
    tokenizer = EntryTokenizer(chat_tokenizer_dir(model, tmp_path_factory.mktemp("tok")))
    try:
        with running_api(SpeculativeCore(shards, tokenizer, model)) as (url, _):
            yield url, tokenizer
    finally:
        for s in shards:
            s.kill()


def scrape(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def test_same_text_and_drafted_tokens_in_usage_and_metrics(api, model):
    url, tokenizer = api
    ids = tokenizer.encode_prompt(PROMPT, raw=True)      # /v1/completions: the prompt as it is
    tokens = WholeModel(model).generate(ids, NEW_TOKENS).tokens
    cut = next((i for i, t in enumerate(tokens) if t in tokenizer.stop_ids), None)
    expected = tokenizer.decode(tokens if cut is None else tokens[:cut + 1])
    before = scrape(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=NEW_TOKENS)
    after = scrape(url)
    assert out.choices[0].text == expected
    details = out.usage.completion_tokens_details
    assert details is not None
    drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert drafted > 0
    assert after["meshd_draft_tokens_total"] - before.get("meshd_draft_tokens_total", 0) == drafted
    assert (after["meshd_draft_accepted_tokens_total"] - before.get("meshd_draft_accepted_tokens_total", 0)
            == details.accepted_prediction_tokens)


def test_the_switches_are_checked(tmp_path):
    from meshd.config import DaemonConfig, load_config
    from meshd.errors import ConfigError
    from meshd.generate.params import GenerateParams
    from proto.errors import LocalError

    assert DaemonConfig(data_dir=tmp_path).speculative == "off"
    config = tmp_path / "meshd.toml"
    config.write_text('speculative = "prompt-lookup"\n')
    assert load_config(config).speculative == "prompt-lookup"
    with pytest.raises(ConfigError):
        DaemonConfig(data_dir=tmp_path, speculative="draft-model")      # no draft model given
    with pytest.raises(ConfigError):
        DaemonConfig(data_dir=tmp_path, draft_model=tmp_path / "missing.gguf")
    (tmp_path / "draft.gguf").write_bytes(b"GGUF")
    assert DaemonConfig(data_dir=tmp_path, draft_model=tmp_path / "draft.gguf").speculative == "draft-model"
    with pytest.raises(ConfigError):
        DaemonConfig(data_dir=tmp_path, speculative="n-gram")
    assert GenerateParams.from_request({"prompt": "x", "speculative": True}).speculative is True
    with pytest.raises(LocalError):
        GenerateParams(prompt="x", speculative="yes")  # type: ignore[arg-type]
