"""gRPC of the real ``python -m service serve``: two workers serving gRPC on one port, TLS on both listeners,
a gRPC port that is already served, and gRPC off."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from builders import tiny_cnn
from live_server import ROOT, TOKEN, running, upload
from test_workers import worker_pids
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e


def infer_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 3, 8, 8])
    request.raw_input_contents.append(np.ones((1, 3, 8, 8), np.float32).tobytes())
    return request


def listening(pid: int, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(pid).net_connections(kind="tcp"))


def served_by(pids: set[int], port: int, client_port: int) -> int | None:
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.laddr and c.raddr and c.laddr.port == port and c.raddr.port == client_port:
                return pid
    return None


def own_client_ports(port: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}


def test_two_workers_answer_grpc_on_one_port(tmp_path: Path) -> None:
    env = {"SERVICE_WORKERS": "2", "SERVICE_STORE_SYNC_S": "0.2"}
    with running(tmp_path / "models", tmp_path / "logs", env=env) as server:
        port = int(server.grpc_target.rsplit(":", 1)[1])
        assert upload(server.url, "tiny", tiny_cnn(seed=5)).status_code == 201
        pids = worker_pids(server.pid)
        assert len(pids) == 2
        deadline = time.monotonic() + 60
        while not all(listening(pid, port) for pid in pids):
            assert time.monotonic() < deadline, "a worker does not listen for gRPC"
            time.sleep(0.1)
        channels: dict[int, grpc.Channel] = {}
        answered: dict[int, int] = {}
        while len(channels) < 2 and time.monotonic() < deadline:
            before = own_client_ports(port)
            channel = grpc.insecure_channel(server.grpc_target, options=[("grpc.use_local_subchannel_pool", 1)])
            service = pb_grpc.GRPCInferenceServiceStub(channel)
            try:
                service.ModelInfer(infer_request(), timeout=30)
            except grpc.RpcError as exc:  # the other worker may not have picked up (or loaded) the upload yet
                assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE), exc
                channel.close()
                time.sleep(0.2)
                continue
            (client_port,) = own_client_ports(port) - before
            pid = served_by(pids, port, client_port)
            assert pid is not None
            answered[pid] = answered.get(pid, 0) + 1
            if pid in channels:
                channel.close()
            else:
                channels[pid] = channel
        assert set(channels) == pids, f"gRPC reached only {sorted(channels)} of {sorted(pids)}"
        for pid, channel in channels.items():  # each worker counts its own requests
            stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                pb.ModelStatisticsRequest(name="tiny"), timeout=30)
            assert stats.model_stats[0].inference_count == answered[pid]
            channel.close()
        assert server.terminate() == 0


def self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_on_both_listeners(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    env = {"SERVICE_TLS_CERT_FILE": str(cert), "SERVICE_TLS_KEY_FILE": str(key)}
    trusted = ssl.create_default_context(cafile=str(cert))
    with running(tmp_path / "models", tmp_path / "logs", env=env, verify=trusted) as server:
        assert server.url.startswith("https://")
        r = httpx.post(f"{server.url}/v1/models/tiny", content=tiny_cnn(seed=1), verify=trusted, timeout=120,
                       headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/octet-stream"})
        assert r.status_code == 201, r.text
        with pytest.raises(httpx.HTTPError):  # a client that does not trust the certificate
            httpx.get(f"{server.url}/v2/health/ready", timeout=5)
        client = grpcclient.InferenceServerClient(server.grpc_target, ssl=True, root_certificates=str(cert))
        tensor = grpcclient.InferInput("input", [1, 3, 8, 8], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 3, 8, 8), np.float32))
        assert client.infer("tiny", [tensor]).as_numpy("logits").shape == (1, 3)
        with grpc.insecure_channel(server.grpc_target) as plain, pytest.raises(grpc.RpcError):  # no TLS
            pb_grpc.GRPCInferenceServiceStub(plain).ServerLive(pb.ServerLiveRequest(), timeout=5)
        assert "(TLS)" in server.stdout_path.read_text()


def _serve_on(tmp_path: Path, grpc_port: str, workers: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SERVICE_DEMO_MODEL": "false", "SERVICE_DEVICE": "cpu",
           "SERVICE_GRPC_PORT": grpc_port, "SERVICE_WORKERS": workers}
    return subprocess.run([sys.executable, "-m", "service", "serve", "--port", "0", "--model-dir",
                           str(tmp_path / f"models-{workers}")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_grpc_port_that_is_already_served_fails_the_start(tmp_path: Path, workers: str) -> None:
    """Another server's SO_REUSEPORT listener (gRPC's default option) must not be joined silently."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        done = _serve_on(tmp_path, str(other.getsockname()[1]), workers)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cannot listen for gRPC" in done.stderr and "SERVICE_GRPC_PORT" in done.stderr, done.stderr
    assert "listening on grpc://" not in done.stdout


def test_grpc_off(tmp_path: Path) -> None:
    with running(tmp_path / "models", tmp_path / "logs", env={"SERVICE_GRPC_PORT": "off"}) as server:
        assert server.grpc_target is None
        assert "grpc" not in server.stdout_path.read_text()
        ports = {c.laddr.port for c in psutil.Process(server.pid).net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN}
        assert ports == {server.port}
