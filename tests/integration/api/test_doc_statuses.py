"""Every status the pages promise for a named case is the one the real app answers.

A page marks each table of promises with ``<!-- statuses: tests/integration/api/test_doc_statuses.py -->``; a
row names a case in its first cell and promises the HTTP statuses written in its ``status`` column (a cell
without a status promises none). ``CASES`` sends each case, in-process, to the real app and registry with
small models, and gives back every status it got; a row must get exactly what it promises. A case written in a
page without a check here fails (add one), and so does a check no page uses any more.

Queue-full and deadline answers are injected into a real model version (the batcher's own tests,
tests/unit/test_batcher.py, show when it raises them); a full or read-only store is injected below the store
(tests/helpers/faults.py). Everything else happens for real."""

from __future__ import annotations

import errno
import io
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import builders
import httpx
import image_kit
import images
import numpy as np
import onnx
import pytest
from api_kit import AUTH, OCTET, make_settings, serve_app, tiny_cnn, upload
from faults import StoreFaults
from onnx import TensorProto, helper
from shm_kit import region_file

from service.errors import QueueFullError, RequestTimeoutError

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[3]
MARKER = "<!-- statuses: tests/integration/api/test_doc_statuses.py -->"
TINY = tiny_cnn(seed=0)
X = np.zeros((1, 3, 8, 8), np.float32)


def promises() -> list[tuple[str, str, frozenset[int]]]:
    """(page, case, statuses) of every row of every marked table."""
    found = []
    for page in ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]:
        text = (ROOT / page).read_text(encoding="utf-8")
        for table in re.findall(re.escape(MARKER) + r"\n((?:\|.*\n)+)", text):
            rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()]
            column = rows[0].index("status")
            for row in rows[2:]:
                statuses = frozenset(int(code) for code in re.findall(r"\b[1-5]\d\d\b", row[column]))
                found.append((page, row[0], statuses))
    return found


PROMISES = promises()


class Env:
    """The shared app (``tiny``, the image classifier ``cls``, the unloaded ``gone``) and what a case may use."""

    def __init__(self, client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.client, self.tmp_path, self.monkeypatch = client, tmp_path, monkeypatch

    @property
    def store(self) -> Path:
        return Path(self.client.app.state.settings.model_dir)  # type: ignore[attr-defined]

    def version(self, name: str):
        return self.client.app.state.manager.table.get(name)  # type: ignore[attr-defined]

    async def upload(self, name: str, model: bytes, config: object = None, client: httpx.AsyncClient | None = None
                     ) -> httpx.Response:
        params = {"config": config if isinstance(config, str) else json.dumps(config)} if config is not None else None
        return await (client or self.client).post(f"/v1/models/{name}", content=model, params=params,
                                                  headers={**AUTH, "content-type": OCTET})

    async def predict(self, body: object, model: str = "tiny") -> httpx.Response:
        return await self.client.post("/predict", json={"model": model, "inputs": {"input": body}})

    async def v2(self, inputs: list[dict], model: str = "tiny", **extra: object) -> httpx.Response:
        return await self.client.post(f"/v2/models/{model}/infer", json={"inputs": inputs, **extra})


Case = Callable[[Env], Awaitable[set[int]]]


def _statuses(*responses: httpx.Response) -> set[int]:
    return {r.status_code for r in responses}


def _tensor(shape: list[int], datatype: str = "FP32", name: str = "input") -> dict:
    return {"name": name, "shape": shape, "datatype": datatype, "data": [0] * int(np.prod(shape))}


def _model(name: str, dims: list[int]) -> bytes:
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], name,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


# ------------------------------------------------------------------ the cases
async def wrong_input(env: Env) -> set[int]:
    return _statuses(await env.predict(np.zeros((1, 3, 9, 8)).tolist()),
                     await env.v2([_tensor([1, 3, 8, 8], "INT32")]), await env.v2([_tensor([1, 3, 8])]))


async def integer_input(env: Env) -> set[int]:
    half, big = [[[[0.5] * 8] * 8] * 3], [[[[300] * 8] * 8] * 3]
    return _statuses(await env.predict(half, "cls"), await env.predict(big, "cls"))


async def bad_version(env: Env) -> set[int]:
    return _statuses(await env.client.get("/v2/models/tiny/versions/0"),
                     await env.client.post("/predict", params={"version": "1.0"}, json={"model": "tiny",
                                                                                        "inputs": {"input": [1]}}))


async def invalid_model(env: Env) -> set[int]:
    return _statuses(await env.upload("bad", np.random.default_rng(0).bytes(3000)),
                     await env.upload("bad", builders.external_initializer("../../etc/passwd")),
                     await env.upload("bad", builders.custom_domain()),
                     await env.upload("bad", builders.value_dependent_bomb()),
                     await env.upload("bad", builders.newest_ir(builders.tiny_cnn(), onnx.defs.onnx_opset_version())))


async def missing_extension(env: Env) -> set[int]:
    answers = [await env.client.get("/v2/trace/setting"), await env.client.post("/v2/logging", json={})]
    assert all("is not supported by this server" in r.json()["error"] for r in answers), [r.text for r in answers]
    return _statuses(*answers)


def _shm_file(size: int) -> tuple[str, Path]:
    """A region file of the test's user in /dev/shm, and its key."""
    key = f"/doc-statuses-{uuid.uuid4().hex[:10]}"
    return key, region_file(Path("/dev/shm"), key, size)


async def shared_memory_bounds(env: Env) -> set[int]:
    key, path = _shm_file(768)
    try:
        register = await env.client.post("/v2/systemsharedmemory/region/doc/register",
                                         json={"key": key, "offset": 0, "byte_size": 768})
        assert register.status_code == 200, register.text
        region = {"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32"}
        past = await env.v2([{**region, "parameters": {"shared_memory_region": "doc", "shared_memory_byte_size": 768,
                                                       "shared_memory_offset": 8}}])
        unknown = await env.v2([{**region, "parameters": {"shared_memory_region": "nope",
                                                          "shared_memory_byte_size": 768}}])
        outside = await env.client.post("/v2/systemsharedmemory/region/x/register",
                                        json={"key": "/../etc/passwd", "byte_size": 8})
        return _statuses(past, unknown, outside)
    finally:
        await env.client.post("/v2/systemsharedmemory/unregister")
        path.unlink()


async def shared_memory_remote(env: Env) -> set[int]:
    app = env.client.app  # type: ignore[attr-defined]
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=("203.0.113.7", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as remote:
        answers = [await remote.get("/v2/systemsharedmemory/status"),
                   await remote.post("/v2/cudasharedmemory/unregister"),
                   await remote.post("/v2/systemsharedmemory/region/r/register", json={"key": "/k", "byte_size": 8})]
    assert all("SERVICE_SHARED_MEMORY_REMOTE" in r.json()["error"] for r in answers), [r.text for r in answers]
    return _statuses(*answers)


async def shared_memory_unknown(env: Env) -> set[int]:
    return _statuses(await env.client.get("/v2/systemsharedmemory/region/nope/status"),
                     await env.client.get("/v2/cudasharedmemory/region/nope/status"))


async def shared_memory_conflict(env: Env) -> set[int]:
    key, path = _shm_file(64)
    try:
        body = {"key": key, "offset": 0, "byte_size": 64}
        first = await env.client.post("/v2/systemsharedmemory/region/twice/register", json=body)
        assert first.status_code == 200, first.text
        again = await env.client.post("/v2/systemsharedmemory/region/twice/register", json=body)
        huge = await env.client.post("/v2/systemsharedmemory/region/huge/register",
                                     json={**body, "byte_size": 1 << 50})
        return _statuses(again, huge)
    finally:
        await env.client.post("/v2/systemsharedmemory/unregister")
        path.unlink()


async def no_token(env: Env) -> set[int]:
    wrong = {"Authorization": "Bearer wrong-token-0123456789", "content-type": OCTET}
    return _statuses(await env.client.post("/v1/models/x", content=TINY, headers={"content-type": OCTET}),
                     await env.client.post("/v1/models/x", content=TINY, headers=wrong),
                     await env.client.delete("/v1/models/tiny/versions/1"),
                     await env.client.post("/v2/repository/models/tiny/unload"))


async def management_off(env: Env) -> set[int]:
    async with serve_app(make_settings(env.tmp_path, admin_token=None)) as client:
        return _statuses(await env.upload("x", TINY, client=client),
                         await client.post("/v2/repository/models/x/load", headers=AUTH))


async def unknown_model(env: Env) -> set[int]:
    return _statuses(await env.client.get("/v2/models/nope"), await env.predict(X.tolist(), "nope"))


async def unloaded_upload(env: Env) -> set[int]:
    return _statuses(await env.upload("gone", TINY))


async def too_large(env: Env) -> set[int]:
    body = b'{"model": "tiny", "inputs": {"input": [' + b"0," * (600 * 1024) + b"0]}}"  # over 1 MiB
    return _statuses(await env.client.post("/predict", content=body, headers={"content-type": "application/json"}),
                     await env.upload("huge", b"\0" * (3 * 1024 * 1024)))  # over 2 MiB


async def wrong_media_type(env: Env) -> set[int]:
    text = {"content-type": "text/plain"}
    return _statuses(await env.client.post("/predict", content=b"x", headers=text),
                     await env.client.post("/v1/models/x", content=TINY, headers={**AUTH, **text}))


async def optimizer_memory(env: Env) -> set[int]:
    r = await env.upload("bomb", builders.constant_of_shape_bomb())
    assert "SERVICE_OPTIMIZER_MEMORY_MB" in r.text, r.text
    return _statuses(r)


async def optimizer_time(env: Env) -> set[int]:
    async with serve_app(make_settings(env.tmp_path, optimizer_timeout_s=0.05)) as client:
        r = await env.upload("slow", TINY, client=client)
    assert "SERVICE_OPTIMIZER_TIMEOUT_S" in r.text, r.text
    return _statuses(r)


async def refused_by_the_optimizer(env: Env) -> set[int]:
    return await optimizer_memory(env) | await optimizer_time(env)


async def not_served(env: Env) -> set[int]:
    return _statuses(await env.predict(X.tolist(), "gone"))


async def queue_full(env: Env) -> set[int]:
    async def full(*_args: object, **_kwargs: object) -> None:
        raise QueueFullError(retry_after_s=1)

    env.monkeypatch.setattr(env.version("tiny"), "infer", full)
    r = await env.predict(X.tolist())
    assert r.headers.get("retry-after") == "1", r.headers
    return _statuses(r)


async def deadline(env: Env) -> set[int]:
    async def late(*_args: object, **_kwargs: object) -> None:
        raise RequestTimeoutError("request timed out after 30 s")

    env.monkeypatch.setattr(env.version("tiny"), "infer", late)
    return _statuses(await env.predict(X.tolist()))


async def disk_full(env: Env) -> set[int]:
    StoreFaults(env.store, errno.ENOSPC).install(env.monkeypatch)
    return _statuses(await env.upload("tiny", TINY))


async def store_read_only(env: Env) -> set[int]:
    StoreFaults(env.store, errno.EROFS).install(env.monkeypatch)
    return _statuses(await env.upload("tiny", TINY),
                     await env.client.delete("/v1/models/tiny/versions/1", headers=AUTH))


async def store_not_writable(env: Env) -> set[int]:
    full = await disk_full(env)
    env.monkeypatch.undo()
    return full | await store_read_only(env)


async def admin_token(env: Env) -> set[int]:
    return await no_token(env) | await management_off(env)


async def decoded_inputs(env: Env) -> set[int]:
    """4 MiB of decoded inputs at most (``max_request_mb`` 1): 6000 samples of 768 bytes, declared in 100 bytes."""
    assert (await env.upload("roomy", TINY, {"queue_size": 100_000})).status_code == 201
    r = await env.v2([{"name": "input", "shape": [6000, 3, 8, 8], "datatype": "FP32", "data": [0]}], "roomy")
    assert "too large" in r.json()["error"], r.text
    return _statuses(r)


async def model_config_size(env: Env) -> set[int]:
    config = json.dumps({"description": "x" * 1000, "pad": "y" * 70_000})
    files = {"file": ("model.onnx", TINY, OCTET), "config": (None, config)}
    return _statuses(await env.client.post("/v1/models/x", files=files, headers=AUTH),
                     await env.client.post("/v1/models/x", content=TINY,
                                           headers={**AUTH, "content-type": OCTET, "x-model-config": config}))


async def tensor_count(env: Env) -> set[int]:
    many_outputs = [{"name": "logits"}] * 65
    return _statuses(await env.v2([_tensor([1, 3, 8, 8], name=f"i{i}") for i in range(65)]),
                     await env.v2([_tensor([1, 3, 8, 8])], outputs=many_outputs))


async def tensor_rank(env: Env) -> set[int]:
    return _statuses(await env.v2([_tensor([1] * 33)]))


async def json_nesting(env: Env) -> set[int]:
    body = b'{"model": "tiny", "inputs": {"input": ' + b"[" * 2000 + b"]" * 2000 + b"}}"
    return _statuses(await env.client.post("/predict", content=body, headers={"content-type": "application/json"}))


async def npy_body(env: Env) -> set[int]:
    npy = {"content-type": "application/x-npy"}
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    honest = io.BytesIO()
    np.save(honest, X)
    short = honest.getvalue()[:-100]
    header = b"\x93NUMPY\x01\x00" + (5000).to_bytes(2, "little") + b"{" + b" " * 4999
    return _statuses(*[await env.client.post("/predict", params={"model": "tiny"}, content=body, headers=npy)
                       for body in (pickled.getvalue(), short, header)])


async def image_count(env: Env) -> set[int]:
    jpeg = images.jpeg(40, 30, seed=7)
    files = [("image", (f"{i}.jpg", jpeg, "image/jpeg")) for i in range(65)]
    return _statuses(await env.client.post("/predict", params={"model": "cls"}, files=files))


async def image_pixels(env: Env) -> set[int]:
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return _statuses(await env.client.post("/predict", params={"model": "cls"}, content=png,
                                           headers={"content-type": "image/png"}))


async def request_batch(env: Env) -> set[int]:
    r = await env.v2([{"name": "input", "shape": [2000, 3, 8, 8], "datatype": "FP32", "data": [0]}])
    assert "exceeds this model's limit" in r.json()["error"], r.text
    return _statuses(r)


async def model_limits(env: Env) -> set[int]:
    return _statuses(await env.upload("deep", builders.nested_ifs(9)),
                     await env.upload("rank", _model("rank", [1] * 9)),
                     await env.upload("big", _model("big", [1, 2**15, 2**14])))


async def config_not_json(env: Env) -> set[int]:
    return _statuses(await env.upload("x", TINY, "{not json"))


async def config_key(env: Env) -> set[int]:
    return _statuses(await env.upload("x", TINY, {"model_path": "/etc/passwd"}),
                     await env.upload("x", TINY, {"max_batch_size": 5000}))


async def config_fit(env: Env) -> set[int]:
    classifier = image_kit.classifier()
    return _statuses(await env.upload("x", classifier, {"preprocess": {"resize": 32, "crop": [16, 16]}}),
                     await env.upload("x", classifier, {"postprocess": {"labels": ["a", "b"]}}))


CASES: dict[str, Case] = {
    # README.md, "Endpoints"
    "an input of the wrong shape, datatype or rank": wrong_input,
    "JSON numbers with fractions, or out of range, for an integer input (an image model's uint8 pixels)":
        integer_input,
    "a model version that is not a positive integer, on any route": bad_version,
    "a model refused at upload as invalid or unsafe: not ONNX, external data, a custom operator domain, sizes set "
    "by request values, an IR version newer than ONNX Runtime reads that the model needs": invalid_model,
    'a Triton extension this server lacks: trace, logging ("... is not supported by this server"; gRPC: '
    "UNIMPLEMENTED)": missing_extension,
    "a tensor naming a shared-memory region that is not registered, or bytes past its end; a region key that is "
    "not a file of the server's user directly in `/dev/shm`": shared_memory_bounds,
    "the status of a shared-memory region that is not registered": shared_memory_unknown,
    "a shared-memory register, unregister or status call from a client that is not on the server's host (not a "
    "loopback address), unless `SERVICE_SHARED_MEMORY_REMOTE`": shared_memory_remote,
    "a shared-memory region registered twice, or past the server's limits (`SERVICE_SHARED_MEMORY_MB`, 64 "
    "regions)": shared_memory_conflict,
    "an upload, delete, load or unload without the admin token, or with a wrong one": no_token,
    "an upload, delete, load or unload on a server started without `SERVICE_ADMIN_TOKEN`": management_off,
    "an unknown model": unknown_model,
    "an upload to a model unloaded through the repository extension": unloaded_upload,
    "a request body over `SERVICE_MAX_REQUEST_MB`, an upload over `SERVICE_MAX_UPLOAD_MB`": too_large,
    "a body of a media type the route does not take": wrong_media_type,
    "a model refused at upload because optimizing it exceeded its limits, or its optimized graph failed "
    "verification": refused_by_the_optimizer,
    "inference on a model that is unloaded": not_served,
    "a full batching queue (with `Retry-After`)": queue_full,
    "a request past its deadline (`SERVICE_REQUEST_TIMEOUT_S`, or the model's `timeout_s`)": deadline,
    "an upload or delete the store cannot write: a full disk, a read-only store": store_not_writable,
    # docs/security.md, "Limits, defaults and how to change them"
    "admin token": admin_token,
    "upload size": lambda env: too_large(env),
    "inference body": lambda env: too_large(env),
    "decoded inputs of one request": decoded_inputs,
    "model config": model_config_size,
    "tensors per request, requested outputs": tensor_count,
    "rank of a request tensor": tensor_rank,
    "JSON nesting": json_nesting,
    "`.npy` body": npy_body,
    "images per request": image_count,
    "pixels of one image": image_pixels,
    "queue per model version (samples)": queue_full,
    "batch size of one request": request_batch,
    "request deadline (queue + compute)": deadline,
    "optimizer memory (address space)": optimizer_memory,
    "optimizer time": optimizer_time,
    "subgraph depth, nodes, model input rank, fixed input elements": model_limits,
    "disk space": disk_full,
    "a store that cannot be written (read-only mount, permissions)": store_read_only,
    # docs/configuration.md, "Per-model config"
    "a config that is not JSON": config_not_json,
    "an unknown key, or a value out of range": config_key,
    "a config that does not fit the model: an image size that is not the model's, labels that are not its class "
    "count": config_fit,
}


def test_every_promise_has_a_check_and_every_check_a_promise() -> None:
    pages = {page for page, _, _ in PROMISES}
    assert {"README.md", "docs/security.md", "docs/configuration.md"} <= pages, pages
    written = {case for _, case, statuses in PROMISES if statuses}
    assert not written - set(CASES), f"cases without a check here: {sorted(written - set(CASES))}"
    assert not set(CASES) - written, f"checks no page promises any more: {sorted(set(CASES) - written)}"


@pytest.fixture(scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> httpx.AsyncClient:
    async with serve_app(make_settings(tmp_path_factory.mktemp("statuses"))) as client:
        await upload(client, "tiny", TINY)
        await upload(client, "cls", image_kit.classifier(), image_kit.CONFIG)
        await upload(client, "gone", tiny_cnn(seed=3))
        r = await client.post("/v2/repository/models/gone/unload", headers=AUTH)
        assert r.status_code == 200, r.text
        yield client


@pytest.mark.parametrize(("page", "case", "statuses"), [p for p in PROMISES if p[2]],
                         ids=[f"{page}:{case[:48]}" for page, case, statuses in PROMISES if statuses])
async def test_the_promised_status_is_answered(
    shared: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: str, case: str,
    statuses: frozenset[int]
) -> None:
    check = CASES.get(case)
    if check is None:
        pytest.fail(f"{page}: no check for {case!r}: add one to CASES")
    got = await check(Env(shared, tmp_path, monkeypatch))
    assert got == set(statuses), f"{page}: {case!r} promises {sorted(statuses)}, the server answered {sorted(got)}"


def test_the_model_limits_case_builds_what_it_says() -> None:
    """The rank-9 and 2^29-element models are refused for those reasons, not as broken graphs."""
    for dims in ([1] * 9, [1, 2**15, 2**14]):
        onnx.checker.check_model(onnx.load_from_string(_model("m", dims)), full_check=True)
