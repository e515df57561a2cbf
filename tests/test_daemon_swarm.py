"""In-process daemons on loopback (real hosts, DHT, control socket), workers replaced
by their validated CapabilityReport: convergence, status coverage map, graceful leave."""
from __future__ import annotations

import trio

from dht import keys as K
from meshd.cli.status_view import render_status
from meshd.config import DaemonConfig
from meshd.daemon.control import request
from meshd.daemon.node import run_daemon
from meshd.daemon.supervisor import WorkerReady
from proto import shard_runtime_pb2 as pb
from tests._daemon_helpers import DIGEST
from tests.conftest import wait_until

TEST_TIMEOUT_S = 90
SPANS = [(0, 3), (3, 6), (6, 8)]


def _report(start: int, end: int) -> pb.CapabilityReport:
    return pb.CapabilityReport(
        schema_version=pb.SCHEMA_VERSION_1, validated=True, num_layers=8, backend="torch",
        fingerprint=pb.Fingerprint(model_artifact_digest=DIGEST, runtime_recipe_digest="recipe-1"),
        shard_range=pb.ShardRange(start_layer=start, end_layer=end, effective_start_layer=start),
        boundary_dtype=pb.DTYPE_FLOAT32, model_id="tiny-test", kv_budget_tokens=1024)


def test_three_daemons_converge_show_coverage_and_leave(tmp_path):
    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nodes, scopes = [], []
                for i in range(len(SPANS)):
                    boot = (str(nodes[0].host.get_addrs()[0]),) if nodes else ()
                    cfg = DaemonConfig(data_dir=tmp_path / f"n{i}", listen=("/ip4/127.0.0.1/tcp/0",),
                                       bootstrap=boot, record_ttl_s=30)
                    scope = trio.CancelScope()
                    scopes.append(scope)

                    async def one(cfg=cfg, scope=scope, task_status=trio.TASK_STATUS_IGNORED):
                        with scope:
                            await run_daemon(cfg, lambda line: None, handle_signals=False, task_status=task_status)

                    node = await nursery.start(one)
                    nodes.append(node)
                for node, (a, b) in zip(nodes, SPANS):
                    await node.on_worker_ready(WorkerReady("127.0.0.1:1", "127.0.0.1:4443", 1, _report(a, b)))

                async def everyone_sees_all():
                    for node in nodes:
                        recs = await node.dht.fetch(K.model_key(DIGEST))
                        if sorted((r.start_layer, r.end_layer) for r in recs if not r.withdrawn) != SPANS:
                            return False
                    return True

                await wait_until(everyone_sees_all, 30, "convergence")
                reply = await trio.to_thread.run_sync(request, nodes[1].config.control_socket, "status")
                text = render_status(reply)
                assert f"coverage of {DIGEST} (tiny-test): 8 layers, 3 peers, complete" in text
                for (a, b) in SPANS:
                    assert f"  {a}:{b} " in text
                assert len(reply["coverage"][DIGEST]) == 3
                entry = next(e for e in reply["coverage"][DIGEST] if e["peer_id"] == nodes[0].identity.peer_id)
                assert entry["grpc_endpoint"] == "127.0.0.1:4443"

                # graceful leave of node 2: its record disappears everywhere at once
                await nodes[2].advertiser.withdraw_now()
                scopes[2].cancel()

                async def gone():
                    for node in nodes[:2]:
                        recs = await node.dht.fetch(K.model_key(DIGEST))
                        if any(r.peer_id == nodes[2].identity.peer_id and not r.withdrawn for r in recs):
                            return False
                    return True

                await wait_until(gone, 30, "withdrawal")
                reply = await trio.to_thread.run_sync(request, nodes[0].config.control_socket, "status")
                assert "gaps at 6:8" in render_status(reply)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_rebuilt_claim_keeps_the_memory_offered_to_the_tracker(tmp_path):
    """An auto node's record offers its memory (a rebalancing candidate); every claim rebuilt later --
    the first free-KV publication right after the worker is ready, a new reachability verdict --
    keeps it (it once fell back to 0, so the tracker never found a node to move into a gap)."""
    memory = 3 << 20

    async def main():
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                cfg = DaemonConfig(data_dir=tmp_path / "n0", listen=("/ip4/127.0.0.1/tcp/0",), record_ttl_s=30)

                async def one(task_status=trio.TASK_STATUS_IGNORED):
                    await run_daemon(cfg, lambda line: None, handle_signals=False, task_status=task_status)

                node = await nursery.start(one)
                node.memory_budget_bytes = memory          # what WorkerSlot sets before the worker is announced
                await node.on_worker_ready(WorkerReady("127.0.0.1:1", "127.0.0.1:4443", 1, _report(0, 3)))
                await wait_until(lambda: _claimed(node), 30, "the first claim")
                assert node.advertiser.claim.memory_budget_bytes == memory
                assert node.free_kv.offer(500, 1024, trio.current_time() + 1000)   # the worker's free KV moved
                node.refresh_claim()
                claim = node.advertiser.claim
                assert claim.free_kv_tokens == 500 and claim.memory_budget_bytes == memory

                async def published():
                    recs = await node.dht.fetch(K.model_key(DIGEST))
                    return [r for r in recs if not r.withdrawn and r.payload.free_kv_tokens == 500]

                (record,) = await wait_until(published, 30, "the republished record")
                assert record.payload.memory_budget_bytes == memory
                nursery.cancel_scope.cancel()

    trio.run(main)


async def _claimed(node) -> bool:
    return node.advertiser.claim is not None
