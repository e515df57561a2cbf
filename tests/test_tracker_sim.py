"""The tracker over simulated nodes on a fake clock (tests/_tracker_sim.py): it closes gaps by moving
ranges, and when the pool is short every node says by how much; one more node of that size covers."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import trio
import trio.testing

from meshd.cli.status_view import render_status
from meshd.plan.adverts import Span
from meshd.plan.assignment import ModelFootprint
from meshd.plan.footprint import scratch_fields
from meshd.plan.tracker import TRACKER_EPOCH_MS
from meshd.sizes import parse_size
from meshd.swarm.tracker_duty import DUTY_REFRESH_S, GAP_CONFIRMATIONS
from tests._tracker_sim import T0_MS, SimConfig, SimSwarm

DIGEST = "sha256:" + "5e" * 32
# Long enough for a few loads and gap confirmations, far inside one tracker epoch.
SIM_LIMIT_S = 600.0


def run_sim(scenario, footprint: ModelFootprint, config: SimConfig | None = None):
    assert T0_MS % TRACKER_EPOCH_MS == 0   # duty does not rotate under the test

    async def main():
        async with trio.open_nursery() as nursery:
            sim = SimSwarm(footprint, nursery, config or SimConfig())
            with trio.fail_after(SIM_LIMIT_S):
                result = await scenario(sim)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def smollm2_footprint() -> ModelFootprint:
    from meshd.plan.footprint import gguf_footprint
    from native.packaged import smollm2_gguf_path

    return gguf_footprint(Path(smollm2_gguf_path()), DIGEST, "llama.cpp")


def issue_model() -> ModelFootprint:
    """The issue's 1.15 B llama in F16 (hidden 2048, intermediate 5632, 26 layers, 32 heads, 4 KV heads
    of 64, a seeded model's small vocabulary: 2.29 GB of layers) as the planner counts it today, with
    313 MiB of one forward's scratch per node at 4096 KV tokens."""
    hidden, inter, kv_width, vocab = 2048, 5632, 4 * 64, 2048
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * inter + 2 * hidden)
    embed = 2 * vocab * hidden
    return ModelFootprint(DIGEST, (per_layer,) * 26, head_extra_bytes=embed, tail_extra_bytes=embed + 2 * hidden,
                          kv_bytes_per_token_layer=2 * kv_width * 2,
                          **scratch_fields(hidden=hidden, intermediate=inter, heads=32, vocab=vocab))


def file_bytes(fp: ModelFootprint) -> int:
    return sum(fp.layer_weight_bytes) + fp.head_extra_bytes + fp.tail_extra_bytes


def covered(sim: SimSwarm):
    return sim.coverage().fully_covered or None


def test_a_whole_file_node_placed_before_the_low_slice_is_moved_to_close_12_18():
    """The order that left 12:18 uncovered: the high slice (18:30) serves, the whole-file node joins
    before the low slice's record exists and gets 1:11, the low slice takes 0:12; the tracker (the
    low slice, the only head) moves the whole-file node onto 12:18. The slices never reload."""
    fp = smollm2_footprint()
    kv = 1024
    roomy = fp.range_bytes(0, 30, kv)
    whole = fp.range_bytes(10, 20, kv)

    async def scenario(sim: SimSwarm):
        high = sim.start("high", memory=roomy, held=Span(18, 30))
        await sim.until(lambda: high.serving, 120, "the high slice serving")
        whole_node = sim.start("whole", memory=whole)
        await sim.until(lambda: whole_node.serving, 120, "the whole-file node serving")
        placed = whole_node.layers
        low = sim.start("low", memory=roomy, held=Span(0, 12))
        await sim.until(lambda: low.serving, 120, "the low slice serving")
        gap_at = sim.now_ms()
        gap = sim.coverage().gaps()
        await sim.until(lambda: covered(sim), 120, "coverage")
        return placed, gap, (sim.now_ms() - gap_at) / 1000, sim, (high, low, whole_node)

    placed, gap, took_s, sim, (high, low, whole_node) = run_sim(scenario, fp, SimConfig(kv_budget_tokens=kv))
    assert placed == Span(1, 11) and gap == (Span(12, 18),)   # the issue's placement and gap
    assert whole_node.layers == Span(12, 18), whole_node.layers   # moved onto the gap, sized to it
    assert (high.layers, low.layers) == (Span(18, 30), Span(0, 12))
    assert (high.loads, low.loads, whole_node.loads) == (1, 1, 2)   # the slices never reloaded
    assert not sim.lost                                       # 1:11 was served by the low slice all along
    # the gap is confirmed, the node told, its new range loaded: bounded by the simulation's constants
    assert took_s <= (GAP_CONFIRMATIONS + 2) * DUTY_REFRESH_S + sim.config.load_s + 2, took_s


def test_three_nodes_at_45_percent_say_how_short_and_the_named_node_covers_without_a_restart():
    fp = issue_model()
    kv = 4096
    size = file_bytes(fp)
    budget = int(0.45 * size)

    async def scenario(sim: SimSwarm):
        nodes = [sim.start(f"n{i}", memory=budget) for i in range(3)]
        for node in nodes:
            await sim.until(lambda node=node: node.serving, 120, f"{node.name} serving")
        await trio.sleep((GAP_CONFIRMATIONS + 2) * DUTY_REFRESH_S + 2)   # the tracker had its chance
        spans = [n.layers for n in nodes]
        views = [n.pool() for n in nodes]
        named = parse_size(views[0]["message"].split("--memory ")[1].split(",")[0])
        extra = sim.start("named", memory=named)
        await sim.until(lambda: covered(sim), 120, "coverage with the named node")
        return spans, views, named, extra, nodes, sim

    spans, views, named, extra, nodes, sim = run_sim(scenario, fp, SimConfig(kv_budget_tokens=kv))
    assert sorted(spans, key=lambda s: s.start) == [Span(0, 7), Span(7, 14), Span(14, 21)]   # the issue's
    assert all(v == views[0] for v in views)                       # every node says the same
    view = views[0]
    assert view["short"] and view["gaps"] == [[21, 26]]
    assert view["message"].startswith("need ")
    assert "more for layers 21:26: one more node with --memory" in view["message"]
    assert view["node_memory_bytes"] == named and named % (1 << 20) == 0
    assert 0 < view["need_bytes"] < named
    assert extra.layers == Span(21, 26)
    assert [n.loads for n in nodes] == [1, 1, 1]                   # nobody restarted or reloaded
    assert not sim.lost
    entries = [{"peer_id": n.peer_id, "start": s.start, "end": s.end, "num_layers": 26}
               for n, s in zip(nodes, spans)]
    text = render_status({"peer_id": "p", "addresses": [], "peers": [], "routing_table": 0, "worker": {"state": "none"},
                          "own": {"layers": None, "model_digest": DIGEST}, "coverage": {DIGEST: entries}, "pool": view})
    assert "3 peers, gaps at 21:26\n" in text and f"\n  short    {view['message']}\n" in text


def test_the_named_node_is_the_smallest_that_covers_with_the_others_in_place():
    from dataclasses import replace

    from meshd.plan.layout import Member, coverable, pool_shortfall

    fp = issue_model()
    members = tuple(Member(f"n{i}", int(0.45 * file_bytes(fp)), Span(7 * i, 7 * i + 7), movable=i > 0)
                    for i in range(3))
    short = pool_shortfall(fp, members, 4096)
    assert short is not None and short.gaps == (Span(21, 26),)
    still = tuple(replace(m, movable=False) for m in members)
    assert coverable(fp, (*still, Member("new", short.node_bytes)), 4096)
    assert not coverable(fp, (*still, Member("new", short.node_bytes - (1 << 20))), 4096)
    # moving a node to the tail would save the tail's extra bytes only: not worth a reload
    assert not coverable(fp, (*members, Member("new", short.node_bytes * 9 // 10)), 4096)
    assert short.need_bytes == short.node_bytes - fp.scratch_bytes(4096, tail=False)


@pytest.mark.parametrize("order", list(itertools.permutations((0.8, 0.4, 0.3))))
def test_heterogeneous_budgets_cover_in_any_order(order):
    """0.8, 0.4 and 0.3 of the model join one after the other: the pool covers, every range fits
    its node's budget, and the bigger the budget the more layers."""
    fp = ModelFootprint.uniform(DIGEST, 26, 40 << 20, head_extra_bytes=60 << 20, tail_extra_bytes=60 << 20,
                                kv_bytes_per_token_layer=1 << 10)
    kv = 1024
    size = fp.range_bytes(0, 26, kv)

    async def scenario(sim: SimSwarm):
        nodes = []
        for i, share in enumerate(order):
            nodes.append(sim.start(f"h{i}", memory=int(share * size)))
            await sim.until(lambda node=nodes[-1]: node.serving, 120, "serving")
        await sim.until(lambda: covered(sim), 120, "coverage")
        return nodes, sim

    nodes, sim = run_sim(scenario, fp, SimConfig(kv_budget_tokens=kv))
    for node in nodes:
        assert fp.range_bytes(node.layers.start, node.layers.end, kv) <= node.memory
    assert not sim.lost


def test_after_a_node_dies_the_tracker_shifts_a_chain_of_ranges_to_take_in_a_small_newcomer():
    """Four nodes of 8 layers cover 26 (0:8, 8:16, 16:24, 18:26); the second dies: 24 layers of memory
    for 26, every node says it is short. A newcomer of 4 layers cannot fill 8:16 alone, but the
    pool now can: the others shift (each only after the layers it gives up are served by another)."""
    fp = ModelFootprint.uniform(DIGEST, 26, 100 << 20)
    eight = fp.range_bytes(1, 9, 0)

    async def scenario(sim: SimSwarm):
        nodes = []
        for i in range(4):
            nodes.append(sim.start(f"c{i}", memory=eight))
            await sim.until(lambda node=nodes[-1]: node.serving, 120, "serving")
        await sim.until(lambda: covered(sim), 60, "coverage")
        before = {n.name: n.layers for n in nodes}
        nodes[1].kill()
        await sim.until(lambda: nodes[0].pool() and nodes[0].pool()["short"], 60, "the shortfall seen")
        short = [n.pool() for n in nodes if n.alive]
        newcomer = sim.start("small", memory=fp.range_bytes(1, 5, 0))
        await sim.until(lambda: covered(sim), 300, "coverage after the shift")
        return before, short, newcomer, nodes, sim

    before, short, newcomer, nodes, sim = run_sim(scenario, fp, SimConfig(kv_budget_tokens=0))
    assert before == {"c0": Span(0, 8), "c1": Span(8, 16), "c2": Span(16, 24), "c3": Span(18, 26)}
    assert all(v == short[0] for v in short) and short[0]["gaps"] == [[8, 16]]
    assert "one more node with --memory 200MiB" in short[0]["message"]   # the others can shift
    assert nodes[0].loads == 1                                     # the tracker stays
    assert sum(n.loads for n in nodes[2:]) > 2                     # someone shifted
    assert not sim.lost                                            # never a layer's last server
    assert sim.coverage().fully_covered


@pytest.mark.parametrize("nodes,killed", [(12, 4), (8, 3)])
def test_several_nodes_die_at_once_emptying_a_span_and_a_surviving_auto_node_moves_into_it(nodes, killed):
    """``meshd bench churn`` on the fake clock: three fixed ranges (0:2, 2:4, 4:6) and auto nodes of two
    layers each cover a 6-layer model several times over; ``killed`` machines vanish at once, every
    server of one span among them (meshd/benchmarks/churn.py's ``choose_victims``). Nothing moves
    before the dead records expire; then the tracker confirms the gap and moves a surviving auto node
    into it, never dropping the last server of another layer, and the fixed ranges never reload."""
    from meshd.benchmarks.churn import choose_victims, healed, movers

    fp = ModelFootprint.uniform(DIGEST, 6, 100 << 20, head_extra_bytes=20 << 20, tail_extra_bytes=20 << 20,
                                kv_bytes_per_token_layer=1 << 10)
    kv = 1024
    two = max(fp.range_bytes(s, s + 2, kv) for s in (0, 2, 4))   # two layers, wherever they are

    def ads(viewer) -> list[dict]:
        return [{"peer_id": a.peer_id, "start": a.start, "end": a.end} for a in sim_of[0].snapshot(viewer).ads]

    sim_of: list[SimSwarm] = []

    async def scenario(sim: SimSwarm):
        sim_of.append(sim)
        fixed = [sim.start(f"f{i}", layers=Span(2 * i, 2 * i + 2)) for i in range(3)]
        autos = [sim.start(f"a{i}", memory=two) for i in range(nodes - 3)]
        for node in (*fixed, *autos):
            await sim.until(lambda node=node: node.serving, 120, f"{node.name} serving")
        await sim.until(lambda: len(ads(fixed[0].peer_id)) == nodes and covered(sim), 60, "everyone seen")
        await trio.sleep((GAP_CONFIRMATIONS + 2) * DUTY_REFRESH_S)   # settled: nothing pending
        before = ads(fixed[0].peer_id)
        loads = {n.name: n.loads for n in sim.nodes}
        victims, gap = choose_victims(before, fixed[0].peer_id, [], killed)
        doomed = [sim.by_peer[p] for p in victims]
        killed_ms = sim.now_ms()
        for node in doomed:
            node.kill()
        observer = next(n for n in sim.nodes if n.alive and n is not fixed[0])

        def view():
            v = ads(observer.peer_id)
            counts = [sum(1 for a in v if a["start"] <= layer < a["end"]) for layer in range(6)]
            return {"ads": v, "coverage": {"fully_covered": min(counts) > 0}}

        await sim.until(lambda: not view()["coverage"]["fully_covered"], 60, "the gap seen")
        gap_seen_s = (sim.now_ms() - killed_ms) / 1000
        moved_early = {n.name for n in sim.nodes if n.alive and n.loads != loads[n.name]}
        await sim.until(lambda: healed(view(), victims), 300, "coverage without the dead")
        return (before, view()["ads"], gap, doomed, fixed, loads, gap_seen_s, moved_early,
                (sim.now_ms() - killed_ms) / 1000, sim)

    before, after, gap, doomed, fixed, loads, gap_seen_s, moved_early, healed_s, sim = run_sim(
        scenario, fp, SimConfig(kv_budget_tokens=kv))
    dead = {d.peer_id for d in doomed}
    assert len(dead) == killed and all(a["start"] != 0 for a in before if a["peer_id"] in dead)   # entry stays
    assert gap[1] - gap[0] == 2 and gap != (0, 2)
    record_ttl_s = sim.config.record_ttl_ms / 1000
    assert gap_seen_s <= record_ttl_s + 1                        # the dead records expired, no sooner
    assert not moved_early                                       # nobody moved before the gap showed
    moved = movers(before, after, gap)
    assert moved, after
    movers_nodes = [sim.by_peer[m["peer_id"]] for m in moved]
    assert all(n.alive and n.role == "auto" and n.loads == loads[n.name] + 1 for n in movers_nodes)
    assert all(m["to"] == list(gap) for m in moved)              # sized to the gap: two layers
    assert all(n.loads == 1 for n in fixed if n.alive)           # fixed ranges never reload
    assert not sim.lost                                          # never the last server of another layer
    assert sim.coverage().fully_covered
    # records expire, the gap is confirmed in GAP_CONFIRMATIONS refreshes, the mover loads: bounded
    assert healed_s <= record_ttl_s + (GAP_CONFIRMATIONS + 2) * DUTY_REFRESH_S + sim.config.load_s + 2, healed_s
