"""``--memory`` is the whole node's promise: real ``meshd join`` daemons, each inside a memory
cgroup capped at exactly its ``--memory``, cover SmolLM2 and generate the whole model's tokens,
with no OOM kill, each node's slice its range's bytes and its processes' peaks inside the cap."""
from __future__ import annotations

import os

import pytest

from meshd.daemon.local_swarm import LocalSwarm
from meshd.generate.tokenizer import EntryTokenizer
from meshd.testing.cgroup import MemoryCgroup, cgroup_version
from native.llama_reference import reference_generate
from shard.model.memory import process_memory

pytestmark = [pytest.mark.slow, pytest.mark.native]

START_TIMEOUT_S = 90
PROMPT = "Once upon a time, in a small village by the sea,"
N_TOKENS = 16
NODES = 2
# The cgroup counts the node's slice of page cache at MiB granularity and a little kernel memory of its
# own; the slice's metadata and placeholder tensors are within this of its range's tensor bytes.
SLICE_HEADER_ALLOWANCE = 1 << 20


@pytest.mark.skipif(cgroup_version() == "none", reason="needs a writable memory cgroup (root)")
def test_nodes_in_cgroups_capped_at_their_memory_serve_the_model(tmp_path):
    from meshd.plan.assignment import even_memory_for
    from meshd.plan.footprint import model_footprint
    from meshd.testing.models import smollm2_gguf_path
    from native.gguf_range import open_reader, read_range
    from shard.model.backend import LayerRange

    path = smollm2_gguf_path()
    fp = model_footprint(path, "sha256:" + "0" * 64, "llama.cpp")
    memory = even_memory_for(fp, NODES, 4096)
    tok = EntryTokenizer(path)
    expected = list(reference_generate(path, tok.encode_prompt(PROMPT, raw=True), N_TOKENS, n_threads=2,
                                       stop_ids=tok.stop_ids).tokens)
    env = os.environ.pop("MESHD_SLICE_CACHE", None)   # each node cuts its slice into its own data dir
    groups = [MemoryCgroup.create(f"meshd-pool-test-{os.getpid()}-{i}", memory) for i in range(NODES)]
    try:
        with LocalSwarm(tmp_path, path, backend="llama.cpp", record_ttl_s=8.0) as swarm:
            for group in groups:
                swarm.add(memory=memory, wrap=group.wrap)
            swarm.wait_covered(START_TIMEOUT_S, peers=NODES)
            done = [e for e in swarm.daemons[0].generate(PROMPT, max_tokens=N_TOKENS, raw=True) if e.get("done")][0]
            peaks = [(process_memory(d.proc.pid).peak, [process_memory(w).peak for w in d.worker_pids()])
                     for d in swarm.daemons]
            (records,) = swarm.daemons[0].query("status")["coverage"].values()
            published = [sum(r["memory"].values()) for r in records]
            alive = [d.alive() for d in swarm.daemons]
            reader = open_reader(path)
            slices = []
            for d in swarm.daemons:
                layers = d.swarm()["layers"]
                files = list((d.data_dir / "slices").glob("*.gguf"))
                slices.append((layers, files, read_range(reader, LayerRange(*layers, 30)).touched_bytes()))
        print(f"\n--memory {memory >> 20} MiB each ({cgroup_version()}); cgroup peaks "
              f"{[g.peak() >> 20 for g in groups]} MiB; daemon/worker peaks "
              f"{[(d >> 20, [w >> 20 for w in ws]) for d, ws in peaks]} MiB; "
              f"published {[t >> 20 for t in published]} MiB; ranges "
              f"{[(s[0], [f.stat().st_size >> 20 for f in s[1]]) for s in slices]}")
        assert done["tokens"] == expected and all(alive)
        for group, (_, worker_peaks) in zip(groups, peaks):
            assert group.oom_kills() == 0 and group.peak() <= memory and len(worker_peaks) == 1
        # what each node measured of itself (weights, KV, working memory, worker and daemon base) fits
        # its promise; the processes' own peaks count the libraries they share twice, the cgroup once
        assert len(published) == NODES and all(0 < total <= memory for total in published)
        for layers, files, range_bytes in slices:
            if tuple(layers) == (0, 30):
                assert files == []          # the file is the range: nothing written
            else:
                assert len(files) == 1
                assert range_bytes <= files[0].stat().st_size <= range_bytes + SLICE_HEADER_ALLOWANCE
    finally:
        if env is not None:
            os.environ["MESHD_SLICE_CACHE"] = env
        for group in groups:
            group.close()
