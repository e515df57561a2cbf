"""Expert peers in-process and as ``meshd worker --experts`` subprocesses (tests and benchmarks).

* ``tls_files(dir)``: a fresh node certificate + key on disk and its pin.
* ``ExpertPeer.start(path, spec, tls)``: an ExpertStore behind a TLS
  ExpertServer in this process, and the ``Placement`` a holder needs for it.
* ``spawn_expert_worker(path, spec, tls, ...)``: the real thing, a
  ``meshd worker --experts SPEC --expert-listen 127.0.0.1:0`` subprocess;
  ready once its ready file names the port (written after the validation
  forward).
* ``generate(backend, prompt, new_tokens, before_step=...)``: greedy decoding
  through one in-process range backend, with a hook before each decode step
  (where tests kill a peer).
* ``teacher_forced(backend, sequence)``: argmax and logits at every position of
  a fixed sequence (one decode step per token), for drift checks.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from meshd.testing.procs import REPO_ROOT, child_env, stop_process
from shard.experts.pool import Placement
from shard.experts.spec import ExpertSpec

if TYPE_CHECKING:   # torch-heavy: imported when a peer starts
    from shard.edges.expert_server import ExpertServer
    from shard.experts.store import ExpertStore

READY_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    pin: bytes


def tls_files(directory: Path, name: str = "expert") -> TlsFiles:
    """A self-signed P-256 certificate like a node's (meshd/reach/tls.py), and its pin."""
    import datetime as dt
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    key_obj = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert_obj = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key_obj.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("meshd-peer")]), critical=False)
                .sign(key_obj, hashes.SHA256()))
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    cert.write_bytes(cert_obj.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(key_obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    key.chmod(0o600)
    return TlsFiles(cert, key, hashlib.sha256(cert_obj.public_bytes(serialization.Encoding.DER)).digest())


@dataclass
class ExpertPeer:
    server: ExpertServer
    placement: Placement
    store: ExpertStore

    @classmethod
    def start(cls, path: Path, spec: ExpertSpec | str, tls: TlsFiles, peer_id: str = "peer") -> ExpertPeer:
        from shard.edges.expert_server import ExpertServer
        from shard.experts.store import ExpertStore

        spec = ExpertSpec.parse(spec) if isinstance(spec, str) else spec
        store = ExpertStore.load(path, spec)
        fp = store.fingerprint
        import torch

        server = ExpertServer(store, artifact=fp.model_artifact_digest, recipe=fp.runtime_recipe_digest,
                              listen="127.0.0.1:0", tls_cert=str(tls.cert), tls_key=str(tls.key),
                              threads=torch.get_num_threads()).start()   # the caller's count: same numerics
        return cls(server, Placement(peer_id, "127.0.0.1", server.port, tls.pin, spec), store)

    def stop(self) -> None:
        self.server.close()


@dataclass
class ExpertWorker:
    proc: subprocess.Popen
    placement: Placement
    log: Path

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)


def spawn_expert_worker(path: Path, spec: str, tls: TlsFiles, run_dir: Path, *, peer_id: str = "peer",
                        threads: int = 1, extra: Sequence[str] = ()) -> ExpertWorker:
    run_dir.mkdir(parents=True, exist_ok=True)
    ready = run_dir / f"{peer_id}-ready.json"
    log = run_dir / f"{peer_id}.log"
    cmd = [sys.executable, "-m", "meshd", "worker", "--model", str(path), "--experts", spec,
           "--expert-listen", "127.0.0.1:0", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
           "--ready-file", str(ready), "--threads", str(threads), *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env(threads), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"expert worker {peer_id} did not become ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    host, _, port = info["expert_listen"].rpartition(":")
    return ExpertWorker(proc, Placement(peer_id, host, int(port), tls.pin, ExpertSpec.parse(spec)), log)


def generate(backend, prompt: Sequence[int], new_tokens: int, *, chunk: int = 16,
             before_step: Callable[[int], None] | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and per-step logits through one whole-model range backend."""
    cache = backend.new_cache(len(prompt) + new_tokens + 8)
    start = backend.layer_range.start
    logits = None
    for first in range(0, len(prompt), chunk):
        logits = backend.forward(cache, np.array(prompt[first:first + chunk], np.int64), effective_start=start)
    if logits is None:
        raise ValueError("the prompt must hold at least one token")
    tokens, out = [], []
    for step in range(new_tokens):
        out.append(np.array(logits))
        tokens.append(int(np.argmax(logits)))
        if step + 1 == new_tokens:
            break
        if before_step is not None:
            before_step(step)
        logits = backend.forward(cache, np.array([tokens[-1]], np.int64), effective_start=start)
    cache.release()
    return tokens, out


def teacher_forced(backend, sequence: Sequence[int]) -> tuple[list[int], list[np.ndarray]]:
    """argmax and logits after each token of ``sequence`` (one position per step)."""
    cache = backend.new_cache(len(sequence) + 1)
    start = backend.layer_range.start
    argmax, logits = [], []
    for token in sequence:
        row = backend.forward(cache, np.array([token], np.int64), effective_start=start)
        argmax.append(int(np.argmax(row)))
        logits.append(np.array(row))
    cache.release()
    return argmax, logits
