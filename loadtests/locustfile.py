"""Locust load test of the model server: JSON ``/predict``, KServe V2 binary infer, KServe V2 over gRPC,
light management.

Headless (see loadtests/README.md):
    locust -f loadtests/locustfile.py --headless -u 16 -r 8 -t 60s --host http://127.0.0.1:8000

The model's name comes from LOADTEST_MODEL (default: the demo model ``mobilenet_v3_large``); its input
names, datatypes and shapes come from the server's own metadata (``GET /v2/models/{model}``), so the
same file drives any uploaded image model. A response counts as a failure when its status is not 2xx
or when an output's shape is not the one the metadata promises for the batch we sent.

Environment:
    LOADTEST_MODEL        model name (default mobilenet_v3_large)
    LOADTEST_BATCH        samples per request (default 1)
    LOADTEST_SHAPE        per-sample input shape overriding dynamic dims, e.g. "3,224,224"
    LOADTEST_WAIT_S       upper bound of an inference user's random think time (default 0: no pause)
    LOADTEST_ADMIN_TOKEN  bearer token for ``GET /v1/models`` (falls back to SERVICE_ADMIN_TOKEN);
                          without one the management user reads only the public KServe endpoints
    LOADTEST_GRPC_TARGET  host:port of the gRPC listener (default: --host's host, port 8001; "off": no
                          gRPC user)

The gRPC user sends a prebuilt ``ModelInferRequest`` (raw tensors) on one channel per user through the plain
generated stub, and reports each call to locust's ``request`` event as type "grpc". grpc is made
gevent-cooperative (``init_gevent``) before any channel exists, so a call blocks only its own user.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, between, constant, task
from locust.contrib.fasthttp import FastHttpUser
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the sibling module, wherever locust is started from
from payloads import (
    ModelInfo,
    check_grpc_response,
    check_kserve_response,
    check_predict_response,
    grpc_infer_request,
    grpc_metadata,
    kserve_binary_body,
    make_inputs,
    parse_metadata,
    predict_body,
)

MODEL = os.environ.get("LOADTEST_MODEL", "mobilenet_v3_large")
BATCH = int(os.environ.get("LOADTEST_BATCH", "1"))
SHAPE_OVERRIDE = os.environ.get("LOADTEST_SHAPE", "")
WAIT_S = float(os.environ.get("LOADTEST_WAIT_S", "0"))
ADMIN_TOKEN = os.environ.get("LOADTEST_ADMIN_TOKEN") or os.environ.get("SERVICE_ADMIN_TOKEN") or ""
GRPC_TARGET = os.environ.get("LOADTEST_GRPC_TARGET", "")
GRPC_TIMEOUT_S = 30.0

grpc_gevent.init_gevent()


class _ModelUser(FastHttpUser):
    """Shared start-up: read the model's metadata from the server under test."""

    abstract = True
    info: ModelInfo

    def on_start(self) -> None:
        with self.client.get(f"/v2/models/{MODEL}", name="/v2/models/[model]", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"metadata of {MODEL!r}: HTTP {resp.status_code}")
                raise RuntimeError(f"cannot read the metadata of model {MODEL!r}: HTTP {resp.status_code}")
            self.info = parse_metadata(resp.json())


class InferenceUser(_ModelUser):
    """A client sending inference requests back to back: binary KServe (3 of 4) and JSON /predict."""

    weight = 10
    wait_time = between(0, WAIT_S) if WAIT_S > 0 else constant(0)

    def on_start(self) -> None:
        super().on_start()
        arrays = make_inputs(self.info, BATCH, seed=id(self) % 2**32, shape_override=SHAPE_OVERRIDE)
        self.predict_payload = predict_body(self.info, arrays)
        self.binary_payload, self.binary_header_len = kserve_binary_body(self.info, arrays)

    @task(3)
    def infer_binary(self) -> None:
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(self.binary_header_len),
        }
        with self.client.post(
            f"/v2/models/{self.info.name}/infer",
            data=self.binary_payload,
            headers=headers,
            name="/v2/models/[model]/infer (binary)",
            catch_response=True,
        ) as resp:
            if not 200 <= resp.status_code < 300:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200] if resp.text else ''}")
                return
            problem = check_kserve_response(
                self.info, resp.content, resp.headers.get("Inference-Header-Content-Length"), BATCH
            )
            if problem:
                resp.failure(problem)

    @task(1)
    def predict_json(self) -> None:
        with self.client.post(
            "/predict",
            data=self.predict_payload,
            headers={"Content-Type": "application/json"},
            name="/predict",
            catch_response=True,
        ) as resp:
            if not 200 <= resp.status_code < 300:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200] if resp.text else ''}")
                return
            problem = check_predict_response(self.info, resp.json(), BATCH)
            if problem:
                resp.failure(problem)


class GrpcInferenceUser(User):
    """A client sending KServe V2 ``ModelInfer`` calls back to back over gRPC."""

    abstract = GRPC_TARGET.lower() == "off"
    weight = 4
    wait_time = between(0, WAIT_S) if WAIT_S > 0 else constant(0)

    def on_start(self) -> None:
        target = GRPC_TARGET or f"{urlparse(self.host).hostname or '127.0.0.1'}:8001"
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)])
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        metadata = self._call("ModelMetadata", self.stub.ModelMetadata, pb.ModelMetadataRequest(name=MODEL))
        if metadata is None:
            raise RuntimeError(f"cannot read the metadata of model {MODEL!r} over gRPC at {target}")
        self.info = parse_metadata(grpc_metadata(metadata))
        arrays = make_inputs(self.info, BATCH, seed=id(self) % 2**32, shape_override=SHAPE_OVERRIDE)
        self.request = grpc_infer_request(self.info, arrays)

    def on_stop(self) -> None:
        self.channel.close()

    def _call(self, name: str, method, request, check=None):  # -> the response, or None when it failed
        start = time.perf_counter()
        response, failure = None, None
        try:
            response = method(request, timeout=GRPC_TIMEOUT_S)
            problem = check(response) if check is not None else None
            failure = RuntimeError(problem) if problem else None
        except grpc.RpcError as exc:
            failure = RuntimeError(f"{exc.code().name}: {exc.details()}")
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=(time.perf_counter() - start) * 1000,
            response_length=response.ByteSize() if response is not None else 0, exception=failure, context={},
        )
        return None if failure else response

    @task
    def infer_grpc(self) -> None:
        self._call("ModelInfer", self.stub.ModelInfer, self.request,
                   lambda response: check_grpc_response(self.info, response, BATCH))


class ManagementUser(_ModelUser):
    """One operator polling the model list and metadata now and then, as a dashboard would."""

    fixed_count = 1
    wait_time = between(0.5, 1.5)

    @task(2)
    def list_models(self) -> None:
        if not ADMIN_TOKEN:
            self.model_metadata()
            return
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        with self.client.get("/v1/models", headers=headers, name="/v1/models", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
            elif MODEL not in resp.text:
                resp.failure(f"model {MODEL!r} is not in the list")

    @task(1)
    def model_metadata(self) -> None:
        with self.client.get(f"/v2/models/{MODEL}", name="/v2/models/[model]", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
            elif parse_metadata(resp.json()).inputs != self.info.inputs:
                resp.failure("model metadata changed under load")

    @task(1)
    def ready(self) -> None:
        with self.client.get("/v2/health/ready", name="/v2/health/ready", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
