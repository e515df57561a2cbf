"""Heavy real-process exactness checks (CI runs them with -m slow).

2 and 3 `meshd worker` processes over disjoint ranges reproduce the whole
model in one process: 32 greedy tokens equal, and the largest logit
difference is printed (fp32 and bf16 are expected to be exactly 0 here).
"""
from __future__ import annotations

import pytest
import torch

from meshd.testing import models as testmodels
from meshd.testing.procs import spawn_workers
from tests._shard_helpers import check_route_equals_whole

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def _run(path, specs, num_layers, *, dtype="float32", label, prompt=None, chunk=16):
    workers = spawn_workers(path, specs, dtype=dtype, threads=1)
    try:
        kwargs = {"prompt": prompt} if prompt is not None else {}
        return check_route_equals_whole(path, workers, specs, num_layers, dtype=dtype, label=label,
                                        chunk=chunk, **kwargs)
    finally:
        for w in workers:
            w.stop()


def test_random_llama_three_workers_fp32():
    assert _run(testmodels.build_random_llama(), ["0:2", "2:4", "4:6"], 6, label="random llama") == 0.0


def test_random_llama_two_workers_bf16():
    assert _run(testmodels.build_random_llama(), ["0:3", "3:6"], 6, dtype="bfloat16", label="random llama") == 0.0


@pytest.mark.parametrize("specs", [["0:3", "3:6"], ["0:2", "2:5", "5:6"]])
def test_gemma3_split(specs):
    assert _run(testmodels.build_random_gemma3(), specs, 6, label="random gemma3") == 0.0


def _smollm2_prompt(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok("The capital of France is Paris. The capital of Germany is")["input_ids"]


@pytest.mark.parametrize("specs", [["0:15", "15:30"], ["0:10", "10:20", "20:30"]])
def test_smollm2_fp32_split(specs):
    path = testmodels.smollm2_artifact("float32")
    diff = _run(path, specs, 30, label="SmolLM2-135M fp32", prompt=_smollm2_prompt(path), chunk=128)
    assert diff == 0.0


def _self_signed(tmp_path):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshd-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    return cert_pem


def test_tls_port_serves_a_generation(tmp_path):
    import grpc

    from meshd.generate.routes import FactoryConnector, fixed_route
    from meshd.generate.transports import GrpcTransport
    from shard.edges.grpc_server import GRPC_OPTIONS
    from shard.model.reference import WholeModel
    from tests._shard_helpers import PROMPT, drive_fixed

    cert_pem = _self_signed(tmp_path)
    path = testmodels.build_random_llama()
    workers = spawn_workers(path, ["0:6"], threads=1, extra=[
        "--tls-listen", "127.0.0.1:0", "--tls-cert", str(tmp_path / "cert.pem"),
        "--tls-key", str(tmp_path / "key.pem")])
    try:
        assert workers[0].tls_endpoint and workers[0].tls_endpoint != workers[0].endpoint

        def tls_channel(endpoint):
            return GrpcTransport(grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(root_certificates=cert_pem),
                                                     options=GRPC_OPTIONS))

        got = drive_fixed(fixed_route([(workers[0].tls_endpoint, 0, 6)], 6), PROMPT, 8,
                          connector=FactoryConnector(tls_channel))
        assert got.tokens == WholeModel(path).generate(PROMPT, 8, chunk_tokens=16).tokens
    finally:
        for w in workers:
            w.stop()


def test_plaintext_refused_off_loopback(tmp_path):
    import subprocess
    import sys

    from meshd.testing.procs import child_env

    out = subprocess.run([sys.executable, "-m", "meshd", "worker", "--model", str(testmodels.build_random_llama()),
                          "--layers", "0:6", "--listen", "0.0.0.0:0"], env=child_env(1), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "loopback" in out.stderr
