"""The daemon's MoE pieces without a swarm: config, worker commands, the expert advertiser, CLI refusals."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.expert_records import ExpertClaim, validate_experts
from meshd.config import load_config
from meshd.daemon.experts_part import ExpertAdvertiser, ExpertWorkerSpec
from meshd.daemon.worker_process import WorkerSpec
from meshd.errors import ConfigError
from meshd.plan.experts import runs_of
from shard.experts.pool import Placement, placements_from_json, placements_to_json
from shard.experts.spec import ExpertSpec
from tests._daemon_helpers import DIGEST, NOW_MS, identity

MODEL = Path("/models/qwen3-moe")


def test_config_experts_keys(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('model = "/models/m"\nlayers = "0:3"\nexperts = "0-2:E0-E3"\nexpert_act = "q8"\n')
    config = load_config(toml)
    assert config.experts == "0-2:E0-E3" and config.expert_act == "q8" and not config.expert_peer
    peer = load_config(None, {"model": MODEL, "experts": "0-5:E4-E7"})
    assert peer.expert_peer and peer.layers is None
    auto = load_config(None, {"model": MODEL, "experts": "auto", "memory_bytes": "64MiB"})
    assert auto.expert_peer and auto.memory_bytes == 64 << 20


@pytest.mark.parametrize("overrides,match", [
    ({"model": MODEL, "experts": "0-2:X"}, "bad experts"),
    ({"model": MODEL, "experts": "auto"}, "needs --memory"),
    ({"model": MODEL, "layers": (0, 3), "experts": "auto"}, "without --layers"),
    ({"model": MODEL, "auto_layers": True, "memory_bytes": 1 << 30, "experts": "0:E0"}, "not supported"),
    ({"experts": "0:E0"}, "needs --model"),
    ({"model": MODEL, "layers": (0, 3), "expert_act": "int4", "experts": "0:E0"}, "expert_act"),
    ({"model": MODEL, "layers": (0, 3), "offload_experts": True}, "offload_experts needs experts"),
    ({"model": MODEL}, "go together"),
])
def test_config_experts_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_worker_commands_carry_the_expert_flags(tmp_path):
    class Tls:
        cert_path, key_path = tmp_path / "c", tmp_path / "k"

    spec = WorkerSpec(model=MODEL, layers=(0, 3), run_dir=tmp_path, tls=Tls, experts="0-2:E0-E3",
                      expert_peers=tmp_path / "expert-peers.json", expert_act="q8")
    cmd = spec.command(tmp_path / "ready")
    at = cmd.index("--experts")
    assert cmd[at + 1] == "0-2:E0-E3" and cmd[cmd.index("--expert-peers") + 1].endswith("expert-peers.json")
    assert cmd[cmd.index("--expert-act") + 1] == "q8" and "--offload-experts" not in cmd
    plain = WorkerSpec(model=MODEL, layers=(0, 3), run_dir=tmp_path, tls=Tls).command(tmp_path / "ready")
    assert "--experts" not in plain and "--expert-peers" not in plain
    peer = ExpertWorkerSpec(model=MODEL, experts="0-5:E4-E7", run_dir=tmp_path, tls=Tls).command(tmp_path / "r")
    assert "--layers" not in peer and peer[peer.index("--expert-listen") + 1] == "127.0.0.1:0"


def test_placement_file_round_trip():
    placed = [Placement("12D3KooWpeer", "10.0.0.2", 7001, b"\x01" * 32, ExpertSpec.parse("0-3:E4-E7+shared"))]
    assert placements_from_json(placements_to_json(placed)) == placed
    with pytest.raises(ValueError):
        placements_from_json('{"peers": [{"peer_id": "x", "endpoint": "h:0", "experts": "0:E0"}]}')


def _claim() -> ExpertClaim:
    return ExpertClaim(model_artifact_digest=DIGEST, runtime_recipe_digest="sha256:" + "cd" * 32,
                       runs=runs_of(ExpertSpec.parse("0-5:E4-E7")), num_layers=6, num_experts=8,
                       endpoint="127.0.0.1:7001", tls_cert_sha256=b"\x02" * 32)


def test_expert_advertiser_publishes_republishes_and_withdraws():
    published = []
    ttl_s = 30.0

    async def publish(record):
        published.append((trio.current_time(), record))
        return 1

    async def main():
        t0 = trio.current_time()
        adv = ExpertAdvertiser(identity(61), publish, ttl_s=ttl_s,
                               wall_ms=lambda: NOW_MS + int(trio.current_time() * 1000))
        async with trio.open_nursery() as nursery:
            await nursery.start(adv.run)
            adv.set_claim(_claim())
            await trio.sleep(21)
            await adv.withdraw_now()
            nursery.cancel_scope.cancel()
        times = [round(t - t0) for t, _ in published]
        assert times == [0, 10, 20, 21]
        records = [r for _, r in published]
        assert [r.withdrawn for r in records] == [False, False, False, True]
        assert [r.sequence for r in records] == sorted({r.sequence for r in records})
        now = NOW_MS + 21_000
        assert validate_experts(records[-1].raw, now).withdrawn
        assert validate_experts(records[0].raw, NOW_MS).payload.endpoint == "127.0.0.1:7001"

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _worker_args(**kw) -> argparse.Namespace:
    from meshd.cli import worker

    parser = argparse.ArgumentParser()
    worker.add_arguments(parser)
    argv = ["--model", str(MODEL)]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [value])
    return parser.parse_args(argv)


@pytest.mark.parametrize("kw,match", [
    ({}, "needs --experts SPEC and --expert-listen"),
    ({"experts": "0:E0"}, "needs --experts SPEC and --expert-listen"),
    ({"experts": "0:E0", "expert_listen": "127.0.0.1:0"}, "TLS only"),
])
def test_expert_worker_refuses_incomplete_arguments(capsys, kw, match):
    from meshd.cli import worker

    assert worker.run(_worker_args(**kw)) == 2
    assert match in capsys.readouterr().err


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(
                        ["peers", "peer_id", "endpoint", "cert_sha256", "experts"]), kids, max_size=5),
                    max_leaves=12))
def test_fuzz_placement_file(data):
    import json

    try:
        placements_from_json(json.dumps(data))
    except ValueError:
        pass
