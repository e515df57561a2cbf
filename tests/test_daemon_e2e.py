"""Four `meshd join` daemons (one bootstrap) with real workers on a tiny random Llama.

Real subprocesses on loopback: every daemon sees every capability record,
`meshd status` prints the full coverage map, a killed worker is restarted
(its record withdrawn meanwhile), a daemon stopped with SIGTERM withdraws at
once, and a daemon killed outright drops off the map within the record TTL.
A peer's TLS endpoint from the DHT is reached through the pinned channel.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._daemon_helpers import REPO_ROOT, subprocess_env
from tests.conftest import wait_until_blocking

pytestmark = pytest.mark.slow

SPANS = [(0, 2), (2, 4), (4, 6), (3, 6)]
RECORD_TTL_S = 8
# Four workers load torch and validate on 2 shared cores.
CONVERGE_TIMEOUT_S = 300
POLL_S = 0.5


class Daemon:
    def __init__(self, root: Path, index: int, model: Path, span: tuple[int, int], bootstrap: str | None,
                 extra: tuple[str, ...] | list[str] = ()):
        self.data_dir = root / f"d{index}"
        self.log = root / f"d{index}.log"
        args = [sys.executable, "-m", "meshd", "join", "--model", str(model), "--layers", f"{span[0]}:{span[1]}",
                "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(self.data_dir),
                "--record-ttl", str(RECORD_TTL_S)]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        args += list(extra)
        self.log_file = open(self.log, "w")
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=subprocess_env(), stdout=self.log_file,
                                     stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text()

    def address(self) -> str:
        def find():
            m = re.search(r"listening on (\S+/p2p/\S+)", self.text())
            return m.group(1) if m else None
        return wait_until_blocking(self.alive(find), 60, "the bootstrap daemon's address", poll_s=POLL_S)

    def status(self, as_json: bool = True):
        r = subprocess.run([sys.executable, "-m", "meshd", "status", "--data-dir", str(self.data_dir)]
                           + (["--json"] if as_json else []), cwd=REPO_ROOT, env=subprocess_env(),
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return None
        return json.loads(r.stdout) if as_json else r.stdout

    def alive(self, fn):
        """``fn`` for a wait: the test fails at once, with this daemon's log, if the daemon exits."""
        def check():
            got = fn()
            if not got and self.proc.poll() is not None:
                pytest.fail(f"daemon {self.data_dir.name} exited during the wait:\n{self.text()[-3000:]}")
            return got
        return check

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.log_file.close()


def spans_seen(daemon: Daemon) -> list[tuple[int, int]] | None:
    s = daemon.status()
    if not s or not s["coverage"]:
        return None
    (entries,) = s["coverage"].values()
    return sorted((e["start"], e["end"]) for e in entries)


def test_four_daemon_swarm(tmp_path):
    from meshd.testing.models import build_random_llama

    model = build_random_llama(seed=0)
    daemons: list[Daemon] = []
    try:
        daemons.append(Daemon(tmp_path, 0, model, SPANS[0], None))
        boot = daemons[0].address()
        for i, span in enumerate(SPANS[1:], start=1):
            daemons.append(Daemon(tmp_path, i, model, span, boot))
        everything = sorted(SPANS)
        for d in daemons:
            wait_until_blocking(d.alive(lambda d=d: spans_seen(d) == everything), CONVERGE_TIMEOUT_S,
                                f"full coverage at {d.data_dir.name}", poll_s=POLL_S)
        text = daemons[2].status(as_json=False)
        print(text)
        assert "6 layers, 4 peers, complete" in text
        for a, b in SPANS:
            assert re.search(rf"^\s+{a}:{b}\s+[#.]+\s+12D3KooW", text, re.M), text
        assert re.search(r"^\s+peers\s+111222$", text, re.M), text  # peers per layer
        own = daemons[1].status()
        assert own["worker"]["state"] == "ready" and own["own"]["advertising"]

        # the TLS endpoint advertised in the DHT is reachable only through its pin
        _check_pinned_endpoint(daemons[0].status(), daemons[1])

        # a route planned from daemon 0's view of the DHT, over pinned TLS, is exact
        _generate_over_pinned_route(daemons[0].status(), model)

        # forgeries of daemon 1's record pushed straight to daemon 0 are all refused
        _push_forgeries(daemons[0], daemons[1])

        # kill daemon 1's worker: withdrawn meanwhile, restarted, advertised again
        victim = daemons[1]
        worker_pid = victim.status()["worker"]["pid"]
        os.kill(worker_pid, signal.SIGKILL)
        # withdrawn while the worker reloads (a restart imports torch and reloads: seconds)
        wait_until_blocking(lambda: (seen := spans_seen(daemons[0])) is not None and SPANS[1] not in seen,
                            30, "daemon 1's withdrawal while its worker restarts", poll_s=POLL_S)
        wait_until_blocking(victim.alive(lambda: (victim.status() or {}).get("worker", {}).get("restarts") == 1),
                            60, "a worker restart", poll_s=POLL_S)
        wait_until_blocking(victim.alive(lambda: (s := victim.status()) and s["worker"]["state"] == "ready"
                                         and s["worker"]["pid"] != worker_pid),
                            CONVERGE_TIMEOUT_S, "the restarted worker ready", poll_s=POLL_S)
        wait_until_blocking(lambda: spans_seen(daemons[0]) == everything, 60, "coverage after the restart",
                            poll_s=POLL_S)

        # graceful stop of daemon 3: withdrawn at once, exit 0, worker gone
        d3_worker = daemons[3].status()["worker"]["pid"]
        t0 = time.monotonic()
        assert daemons[3].stop(signal.SIGTERM) == 0
        wait_until_blocking(lambda: spans_seen(daemons[0]) == sorted(SPANS[:3]), RECORD_TTL_S, "daemon 3's withdrawal",
                            poll_s=POLL_S)
        assert time.monotonic() - t0 < 60
        assert not _alive(d3_worker)
        assert "leaving the swarm" in daemons[3].text()

        # daemon 2 killed outright: no withdrawal, its record expires within the TTL
        d2_worker = daemons[2].status()["worker"]["pid"]
        daemons[2].stop(signal.SIGKILL)
        t_kill = time.monotonic()
        wait_until_blocking(lambda: spans_seen(daemons[0]) == sorted(SPANS[:2]), RECORD_TTL_S + 10,
                            "daemon 2's record to expire", poll_s=POLL_S)
        assert time.monotonic() - t_kill <= RECORD_TTL_S + 10
        wait_until_blocking(lambda: not _alive(d2_worker), 30, "the orphaned worker to exit", poll_s=POLL_S)
        text = daemons[0].status(as_json=False)
        assert "gaps at 4:6" in text
    finally:
        for d in daemons:
            if d.proc.poll() is None:
                d.stop(signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _check_pinned_endpoint(status: dict, other: Daemon) -> None:
    """Dial ``other``'s worker with the endpoint and pin that daemon 0 read from the DHT."""
    from meshd.errors import CertificateMismatch
    from meshd.reach.tls import pinned_channel
    from proto import shard_runtime_pb2 as pb
    from proto import shard_runtime_pb2_grpc as pb_grpc

    (entries,) = status["coverage"].values()
    advertised = next(e for e in entries if e["peer_id"] == other.status()["peer_id"])
    pin = bytes.fromhex(advertised["tls_cert_sha256"])
    with pinned_channel(advertised["grpc_endpoint"], pin) as channel:
        report = pb_grpc.ShardRuntimeStub(channel).GetCapability(
            pb.CapabilityRequest(schema_version=pb.SCHEMA_VERSION_1), timeout=30)
        assert report.validated and (report.shard_range.start_layer, report.shard_range.end_layer) == SPANS[1]
    with pytest.raises(CertificateMismatch):  # another node's pin: refused before any RPC
        pinned_channel(advertised["grpc_endpoint"], bytes.fromhex(entries[0]["tls_cert_sha256"])
                       if entries[0]["peer_id"] != advertised["peer_id"] else bytes(32))


def _push_forgeries(target: Daemon, victim: Daemon) -> None:
    """A separate (Noise) libp2p host sends raw PUT_VALUEs of forged records to ``target``."""
    import multiaddr
    import trio
    from libp2p.kad_dht.pb.kademlia_pb2 import Record
    from libp2p.kad_dht.value_store import ValueStore
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from dht import keys as K
    from dht.host.build import running_host
    from dht.identity import Identity
    from tests._daemon_helpers import as_record_set, forged_records, identity

    before = target.status()
    (digest,) = before["coverage"]
    victim_id = Identity.from_seed((victim.data_dir / "identity.key").read_bytes())
    seq_before = next(e["sequence"] for e in before["coverage"][digest] if e["peer_id"] == victim_id.peer_id)
    table = forged_records(victim_id, identity(97), now=int(time.time() * 1000), digest=digest,
                           high_seq=seq_before + 10**9, replay_seq=seq_before - 1)
    results: dict[str, bool] = {}

    async def main():
        with trio.fail_after(60):
            async with running_host(identity(98), ["/ip4/127.0.0.1/tcp/0"]) as host:
                info = info_from_p2p_addr(multiaddr.Multiaddr(before["addresses"][0]))
                await host.connect(info)
                store = ValueStore(host, host.get_id())
                for name, raw in table.items():
                    for key, value in ((K.peer_key(victim_id.peer_id), raw),
                                       (K.model_key(digest), as_record_set(raw)),
                                       (K.span_key(digest, *SPANS[1]), as_record_set(raw))):
                        kb = key.encode()
                        ok = await store._store_at_peer(ID.from_base58(before["peer_id"]), kb, value,
                                                        record=Record(key=kb, value=value))
                        results[f"{name} {key.split('/')[2]}"] = ok

    trio.run(main)
    print("pushed forgeries, accepted?", results)
    assert not any(results.values()), results
    after = target.status()
    entry = next(e for e in after["coverage"][digest] if e["peer_id"] == victim_id.peer_id)
    assert (entry["start"], entry["end"]) == SPANS[1]
    assert seq_before <= entry["sequence"] < seq_before + 10**9  # only the victim's own republishes


def _generate_over_pinned_route(status: dict, model: Path) -> None:
    """Hops 0:2 -> 2:4 -> 4:6 from the coverage map; every channel pinned by the DHT record
    (the product's PeerConnector, keyed by peer id)."""
    from meshd.generate.routes import FixedRouteSource, PeerConnector
    from meshd.plan.routing import Hop, Route
    from shard.model.reference import WholeModel
    from tests._shard_helpers import drive_fixed

    (entries,) = status["coverage"].values()
    by_span = {(e["start"], e["end"]): e for e in entries}
    chain = [by_span[s] for s in [(0, 2), (2, 4), (4, 6)]]
    hops = tuple(Hop(e["peer_id"], e["start"], e["end"], e["start"], False, e["grpc_endpoint"]) for e in chain)
    pins = {e["peer_id"]: bytes.fromhex(e["tls_cert_sha256"]) for e in chain}
    prompt = [1, 5, 9, 13, 17, 21]
    split = drive_fixed(FixedRouteSource(Route("", chain[0]["num_layers"], hops)), prompt, 6,
                        connector=PeerConnector(pins=pins))
    whole = WholeModel(model).generate(prompt, 6)
    print("pinned route tokens", split.tokens, "whole model", whole.tokens)
    assert split.tokens == whole.tokens
