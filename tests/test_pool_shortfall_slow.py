"""A swarm short of memory, with real daemons: it says how short, and a node of the named size closes
the gap without any restart.

Two real ``meshd join --layers auto`` daemons (torch, the tiny seeded 6-layer Llama) declare the
memory of two layers with the embeddings: the second gets the next two layers and the last ones
have no server. Then:

* every node's ``meshd status`` (the control socket's status reply, rendered as the CLI does), the
  dashboard's JSON and the API's 503 body carry the same sentence: the layers without a server,
  the memory missing and the ``--memory`` of one more node that covers them;
* a third daemon started with exactly that ``--memory`` is assigned the gap and the model is
  covered, while the first two keep their daemon and worker processes (no restart);
* the swarm then generates the whole model's greedy tokens.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from meshd.cli.status_view import render_status
from meshd.daemon.local_swarm import LocalSwarm, wait_for

pytestmark = pytest.mark.slow

KV_TOKENS = 1024
RECORD_TTL_S = 8.0
START_TIMEOUT_S = 240
PROMPT = "the swarm answers"
N_TOKENS = 16


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_short_swarm_says_how_short_and_a_node_of_the_named_size_closes_the_gap(tmp_path):
    from meshd.plan.assignment import simulate_joins
    from meshd.plan.footprint import artifact_footprint
    from meshd.testing.models import build_random_llama
    from tests.test_swarm_e2e import generate, reference_tokens

    model = build_random_llama(seed=3)
    fp = artifact_footprint(model, "shortfall")
    memory = fp.range_bytes(0, 2, KV_TOKENS)       # two layers with the embeddings
    planned = simulate_joins(fp, 2, memory, KV_TOKENS)
    (gap,) = planned.gaps()                        # two such nodes leave the last layers unserved
    with LocalSwarm(tmp_path, model, kv_budget_tokens=KV_TOKENS, record_ttl_s=RECORD_TTL_S) as swarm:
        first = swarm.add(memory=memory)
        second = swarm.add(memory=memory)        # starts while the first loads; asks it once it serves
        swarm.wait_serving(first, START_TIMEOUT_S)
        swarm.wait_serving(second, START_TIMEOUT_S)

        def short(daemon):
            status = daemon.query("status")
            pool = (status or {}).get("pool") or {}
            digest = (status or {}).get("own", {}).get("model_digest")
            return status if pool.get("short") and len(status["coverage"].get(digest, ())) == 2 else None
        statuses = [wait_for(lambda d=d: short(d), "the shortfall in meshd status", 60, d) for d in swarm.daemons]
        pool = statuses[0]["pool"]
        message = pool["message"]
        print("\nmeshd status:", message)
        assert all(s["pool"] == pool for s in statuses)                  # every node, the same view
        assert pool["gaps"] == [[gap.start, gap.end]] and f"for layers {gap.start}:{gap.end}: " in message
        assert "one more node with --memory" in message and pool["node_memory_bytes"] > 0
        for s in statuses:
            assert f"  short    {message}\n" in render_status(s)

        url = first.api_url()
        dashboard = _get_json(f"{url}/meshd/status")["shortfall"]
        assert dashboard["message"] == message and dashboard["short"] is True
        code, body = _post(f"{url}/v1/chat/completions",
                           {"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        print("503 body:", body["error"]["message"])
        assert code == 503 and message in body["error"]["message"]

        before = {d.name: (d.proc.pid, d.query("status")["worker"]["pid"]) for d in swarm.daemons}
        named = swarm.add(memory=pool["node_memory_bytes"])
        view = swarm.wait_serving(named, START_TIMEOUT_S)
        cover = swarm.wait_covered(START_TIMEOUT_S, peers=3)
        print("covered:", sorted((a["start"], a["end"]) for a in cover["ads"]), "named node:", view["layers"])
        assert view["layers"][0] <= gap.start and view["layers"][1] >= gap.end
        for d in (first, second):                                       # no restart, no reload
            assert d.alive() and (d.proc.pid, d.query("status")["worker"]["pid"]) == before[d.name]
        wait_for(lambda: (first.query("status") or {}).get("pool", "?") is None, "the shortfall gone", 30, first)

        from shard.model.reference import WholeModel

        done = generate(first, PROMPT, N_TOKENS)
        assert done["tokens"] == reference_tokens(WholeModel(model), model, PROMPT, N_TOKENS)
