"""The HTTP API over a real in-process core: real Hypercorn on loopback, real route driver,
real gRPC shards of a tiny random Llama (tests/_swarm_helpers.py), the artifact's tokenizer.

Nothing of the generation is faked: ``InProcessCore`` is the generate core's
``drive`` over a ``SwarmDriver`` whose route source lists the in-process
shards' ads (what the daemon's DHT view would list), the same function the
daemon's core calls after its readiness check.
"""
from __future__ import annotations

import contextlib
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trio

from meshd.api.app import ApiContext, build_app
from meshd.api.entry import Entry, EntryLimits
from meshd.api.metrics import ApiMetrics
from meshd.api.model_card import ModelCard
from meshd.api.server import bind_socket, serve_api
from meshd.generate.driver import SwarmDriver
from meshd.generate.hop_meter import MeteredConnector
from meshd.generate.routes import AdsRouteSource, PeerConnector
from meshd.generate.service import Embeddings, drive, embed_rows
from meshd.generate.tokenizer import EntryTokenizer

NUM_LAYERS = 6
MODEL_ID = "tiny-llama"
# A small ChatML-like template over tokens the test tokenizer knows.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def chat_tokenizer_dir(model: Path, root: Path) -> Path:
    """The model's tokenizer files plus a chat template, in a directory of their own."""
    out = root / "tokenizer"
    out.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model / name).is_file():
            shutil.copy(model / name, out / name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


@dataclass
class InProcessCore:
    shards: list            # tests/_swarm_helpers.LocalShard
    tokenizer: EntryTokenizer
    model_path: Path | None = None   # the artifact (Ollama's model card)

    def driver(self, observer=None) -> SwarmDriver:
        fp = self.shards[0].service.backend.fingerprint
        source = AdsRouteSource(lambda: [s.ad(NUM_LAYERS) for s in self.shards], fp.model_artifact_digest,
                                NUM_LAYERS, entry_peer_id="entry", recipe_digest=fp.runtime_recipe_digest)
        connector = PeerConnector(insecure_loopback=True)
        return SwarmDriver(source, MeteredConnector(connector, observer) if observer else connector,
                           fingerprint=fp, replan_wait_s=0.0)

    async def __call__(self, params, send, *, observer=None) -> None:
        await drive(self.driver(observer), self.tokenizer, params, send)

    async def embed(self, texts, *, truncate=True, normalize=True, observer=None) -> Embeddings:
        """The daemon's embed core over the same shards (meshd/generate/service.py embed, star route)."""
        vectors, total = [], 0
        for text in texts:
            ids = self.tokenizer.encode_prompt(text, raw=True)
            vector = (await embed_rows(self.driver(observer), ids)).astype(np.float64).mean(axis=0)
            if normalize:
                vector = vector / np.linalg.norm(vector)
            vectors.append([float(v) for v in vector])
            total += len(ids)
        return Embeddings(vectors, total)

    def card(self) -> ModelCard | None:
        if self.model_path is None:
            return None
        fp = self.shards[0].service.backend.fingerprint
        return ModelCard.read(self.model_path, MODEL_ID, fp.model_artifact_digest)

    def model(self) -> dict:
        fp = self.shards[0].service.backend.fingerprint
        return {"id": MODEL_ID, "digest": fp.model_artifact_digest, "num_layers": NUM_LAYERS, "serving": True,
                "coverage": None}


@contextlib.contextmanager
def tiny_swarm(tmp: Path):
    """A tiny random Llama split over two in-process gRPC shards; yields (model, shards, core)."""
    import torch

    from meshd.testing.models import build_random_llama
    from tests._swarm_helpers import start_shard

    torch.set_num_threads(1)
    model = build_random_llama(seed=3)
    shards = [start_shard(model, "peer-a", 0, 3), start_shard(model, "peer-b", 3, 6)]
    try:
        yield model, shards, InProcessCore(shards, EntryTokenizer(chat_tokenizer_dir(model, tmp)), model)
    finally:
        for s in shards:
            s.kill()


DEFAULT_LIMITS = EntryLimits()


@contextlib.contextmanager
def running_api(core: InProcessCore, *, limits: EntryLimits = DEFAULT_LIMITS, key: str | None = None,
                allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (), max_connections: int = 8,
                table=None):
    """Serve the app on 127.0.0.1:<free port> in a trio loop on a thread; yields (base url, entry)."""
    entry = Entry(core, limits, ApiMetrics(), embed_core=core.embed)

    async def status() -> dict:
        return {"peer_id": "entry", "generations": entry.snapshot()}

    card = core.card()
    loaded = {"size_bytes": card.size_bytes, "expires_at": "2100-01-01T00:00:00Z"} if card else {}
    app = build_app(ApiContext(entry, core.model, status, key, card=lambda: card, loaded=lambda: loaded,
                               allowed_hosts=allowed_hosts, cors_origins=cors_origins))
    started = threading.Event()
    box: dict = {}

    async def main() -> None:
        sock = bind_socket("127.0.0.1", 0)
        async with trio.open_nursery() as nursery:
            box["url"] = await nursery.start(lambda task_status: serve_api(
                app, sock, max_connections=max_connections, table=table, task_status=task_status))
            box["stop"] = trio.lowlevel.current_trio_token()
            box["cancel"] = nursery.cancel_scope
            started.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test below
            box["error"] = exc
            started.set()

    thread = threading.Thread(target=run, name="api-test-server", daemon=True)
    thread.start()
    assert started.wait(30), "the API server did not start"
    if "error" in box:
        raise box["error"]
    try:
        yield box["url"], entry
    finally:
        trio.from_thread.run_sync(box["cancel"].cancel, trio_token=box["stop"])
        thread.join(30)
        assert not thread.is_alive()
        if "error" in box:
            raise box["error"]
