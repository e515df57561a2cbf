"""Builders and hypothesis strategies shared by tests/test_planner_*.py."""
from __future__ import annotations

from hypothesis import strategies as st

from meshd.plan.adverts import ShardAd

MODEL = "sha256:" + "11" * 32
FAR_FUTURE_MS = 10**12


def make_ad(peer: str, start: int, end: int, n: int = 8, **overrides) -> ShardAd:
    fields = dict(peer_id=peer, model_digest=MODEL, start=start, end=end, num_layers=n,
                  decode_ms_per_layer=1.0, prefill_tokens_per_s=500.0, free_kv_tokens=8192,
                  memory_budget_bytes=8 << 30, relayed=False, expires_at_ms=FAR_FUTURE_MS)
    fields.update(overrides)
    return ShardAd(**fields)


@st.composite
def swarms(draw, *, min_layers: int = 1, max_layers: int = 12, max_peers: int = 8,
           covered: bool = False, recipes: tuple[str, ...] = ("",)):
    """(num_layers, ads) with distinct peer ids; ``covered`` adds a backbone."""
    n = draw(st.integers(min_layers, max_layers))
    count = draw(st.integers(0, max_peers))
    ads = []
    for i in range(count):
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, n))
        ads.append(make_ad(
            f"p{i:02d}", start, end, n,
            decode_ms_per_layer=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5])),
            relayed=draw(st.booleans()),
            free_kv_tokens=draw(st.sampled_from([0, 100, 5000])),
            recipe_digest=draw(st.sampled_from(recipes))))
    if covered:
        cut = draw(st.integers(1, n))
        recipe = recipes[0]
        ads.append(make_ad("backbone-a", 0, cut, n, decode_ms_per_layer=4.0, recipe_digest=recipe))
        if cut < n:
            ads.append(make_ad("backbone-b", cut, n, n, decode_ms_per_layer=4.0, recipe_digest=recipe))
    return n, ads
