"""Hostile shared-memory clients against a real server subprocess (``python -m service serve``), REST and gRPC:
a client that shrinks its region file while its requests read and write it (a server that mapped the file would
die of SIGBUS: the subprocess keeps that signal away from pytest), a region far into a sparse file, and regions
unregistered and registered again while requests use them (no descriptor or mapping of the file may stay open
in the server afterwards: ``/proc/<pid>/fd`` and ``/proc/<pid>/maps``).

The test process never maps a region file either (a mapping would SIGBUS pytest when the file shrinks): it
writes inputs with ``os.pwrite`` and reads outputs with ``os.pread``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import builders
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from live_server import Server, upload
from shm_kit import region_file
from tritonclient.utils import InferenceServerException

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SHM = Path("/dev/shm")
PREFIX = "onnxcnn-hostile-"
BATCH = 16
TENSOR = BATCH * 4 * 4  # one [16, 4] float32 tensor of the pair model (y = a * 2 + b)


class Live:
    """The server subprocess, started again when a test killed it (so one failure does not fail the rest)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.server: Server | None = None

    def get(self) -> Server:
        if self.server is None or self.server.proc.poll() is not None:
            run = uuid4().hex[:6]
            self.server = Server(self.work / "models", self.work / f"logs-{run}",
                                 env={"SERVICE_TUNE_BUDGET_S": "0", "SERVICE_MAX_DELAY_MS": "1"})
            if not (self.work / "models" / "pair").exists():
                reply = upload(self.server.url, "pair", builders.two_inputs())
                assert reply.status_code == 201, reply.text
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    holder = Live(tmp_path_factory.mktemp("hostile-shm"))
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def server(live: Live) -> Server:
    return live.get()


@pytest.fixture
def key() -> Iterator[str]:
    """A fresh region key; its file in /dev/shm is removed after the test."""
    key = f"/{PREFIX}{uuid4().hex[:10]}"
    yield key
    (SHM / key.lstrip("/")).unlink(missing_ok=True)


def _descriptors(pid: int, path: Path) -> list[str]:
    """The server's open descriptors of ``path`` (``/proc/<pid>/fd``)."""
    held = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith(str(path)):
            held.append(f"fd {fd.name} -> {target}")
    return held


def _mappings(pid: int, path: Path) -> list[str]:
    """The server's mappings of ``path`` (``/proc/<pid>/maps``)."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if str(path) in line]


def _rest_body(name: str, batch: int = BATCH) -> dict[str, Any]:
    """KServe V2 JSON: inputs a, b [batch, 4] one after the other at the start of region ``name``, output y
    after them."""
    size = batch * 4 * 4

    def region(at: int) -> dict[str, Any]:
        return {"shared_memory_region": name, "shared_memory_byte_size": size, "shared_memory_offset": at}

    inputs = [{"name": n, "shape": [batch, 4], "datatype": "FP32", "parameters": region(i * size)}
              for i, n in enumerate("ab")]
    return {"inputs": inputs, "outputs": [{"name": "y", "parameters": region(2 * size)}]}


def _grpc_infer(client: grpcclient.InferenceServerClient, name: str, batch: int = BATCH) -> Any:
    """``_rest_body``'s request through tritonclient.grpc."""
    size = batch * 4 * 4
    inputs = []
    for i, n in enumerate("ab"):
        tensor = grpcclient.InferInput(n, [batch, 4], "FP32")
        tensor.set_shared_memory(name, size, i * size)
        inputs.append(tensor)
    out = grpcclient.InferRequestedOutput("y")
    out.set_shared_memory(name, size, 2 * size)
    return client.infer("pair", inputs, outputs=[out])


class Hammer:
    """Clients inferring through one region from threads until ``stop``, REST (httpx) and gRPC (tritonclient);
    every answer is counted by its status, and anything else than a success or a 400 that names what
    ``allowed`` says is kept in ``problems``."""

    def __init__(self, server: Server, name: str, allowed: Callable[[str], bool], clients: int = 2) -> None:
        self.server, self.name, self.allowed = server, name, allowed
        self.stop = threading.Event()
        self.counts = {"ok": 0, "400": 0}
        self.problems: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._rest, daemon=True) for _ in range(clients)] + \
            [threading.Thread(target=self._grpc, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Hammer:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def _count(self, refused: str | None) -> None:
        with self.lock:
            if refused is None:
                self.counts["ok"] += 1
            elif self.allowed(refused):
                self.counts["400"] += 1
            else:
                self.problems.append(refused)

    def _rest(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=30) as client:
            while not self.stop.is_set():
                try:
                    r = client.post("/v2/models/pair/infer", json=_rest_body(self.name))
                except httpx.HTTPError as exc:
                    self._count(f"REST {type(exc).__name__}: {exc}")
                    return
                if r.status_code == 200:
                    self._count(None)
                else:
                    self._count(r.json()["error"] if r.status_code == 400 else f"REST {r.status_code}: {r.text}")

    def _grpc(self) -> None:
        assert self.server.grpc_target is not None
        client = grpcclient.InferenceServerClient(self.server.grpc_target)
        try:
            while not self.stop.is_set():
                try:
                    _grpc_infer(client, self.name)
                    self._count(None)
                except InferenceServerException as exc:
                    bad = exc.status() == "StatusCode.INVALID_ARGUMENT"
                    self._count(str(exc.message()) if bad else f"gRPC {exc.status()}: {exc.message()}")
                    if exc.status() == "StatusCode.UNAVAILABLE":
                        return
        finally:
            client.close()


def _register(server: Server, name: str, key: str, byte_size: int, offset: int = 0, *, grpc: bool = False) -> None:
    if grpc:
        assert server.grpc_target is not None
        client = grpcclient.InferenceServerClient(server.grpc_target)
        try:
            client.register_system_shared_memory(name, key, byte_size, offset)
        finally:
            client.close()
        return
    r = httpx.post(f"{server.url}/v2/systemsharedmemory/region/{name}/register",
                   json={"key": key, "offset": offset, "byte_size": byte_size}, timeout=30)
    assert r.status_code == 200, r.text


def _unregister(server: Server, name: str = "", *, grpc: bool = False) -> None:
    if grpc:
        assert server.grpc_target is not None
        client = grpcclient.InferenceServerClient(server.grpc_target)
        try:
            client.unregister_system_shared_memory(name)
        finally:
            client.close()
        return
    path = f"/region/{name}/unregister" if name else "/unregister"
    r = httpx.post(f"{server.url}/v2/systemsharedmemory{path}", timeout=30)
    assert r.status_code == 200, r.text


def _assert_serving(server: Server) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    r = httpx.post(f"{server.url}/v2/models/pair/infer", timeout=30, json={"inputs": [
        {"name": n, "shape": [2, 4], "datatype": "FP32", "data": a.ravel().tolist()} for n in "ab"]})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == (a * 3).ravel().tolist()


# ------------------------------------------------------------------ a file shrunk under the requests
def test_a_region_file_shrunk_while_requests_use_it_is_a_400_never_a_signal(server: Server, key: str) -> None:
    """The issue's client: its file to 0 bytes and back, over and over, while four clients (REST and gRPC) infer
    with inputs and output in it. The server must answer each request, a 400 naming the region when the file
    was short, and serve on."""
    size = 3 * TENSOR
    path = region_file(SHM, key, size)
    name = f"shrinks-{uuid4().hex[:6]}"
    _register(server, name, key, size)
    with Hammer(server, name, lambda text: repr(name) in text) as hammer:
        fd = os.open(path, os.O_RDWR)
        try:
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and server.proc.poll() is None:
                os.ftruncate(fd, 0)
                time.sleep(0.002)
                os.ftruncate(fd, size)
                time.sleep(0.002)
        finally:
            os.close(fd)
    assert server.proc.poll() is None, f"the server died (exit {server.proc.returncode})"
    assert hammer.problems == [], hammer.problems[:5]
    assert hammer.counts["400"] > 0, hammer.counts  # the shrinking was seen, and answered
    _unregister(server, name)
    _assert_serving(server)


# ------------------------------------------------------------------ a region far into a sparse file
@pytest.mark.parametrize("offset", [2**40, 2**50, 2**61])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_region_far_into_a_sparse_file_serves_without_mapping_the_file(
        server: Server, key: str, offset: int, protocol: str) -> None:
    """A 64-byte region at a far offset of a sparse file: its own bytes are read and written (nothing is mapped,
    so no address space of the size of the offset is taken), on both protocols."""
    path = region_file(SHM, key, offset + 64)
    a, b = np.arange(4, dtype=np.float32).reshape(1, 4), np.full((1, 4), 0.5, np.float32)
    with path.open("r+b", buffering=0) as file:
        os.pwrite(file.fileno(), a.tobytes() + b.tobytes(), offset)
    name = f"far-{uuid4().hex[:6]}"
    grpc = protocol == "grpc"
    _register(server, name, key, 64, offset, grpc=grpc)
    try:
        if grpc:
            assert server.grpc_target is not None
            client = grpcclient.InferenceServerClient(server.grpc_target)
            try:
                _grpc_infer(client, name, batch=1)
            finally:
                client.close()
        else:
            r = httpx.post(f"{server.url}/v2/models/pair/infer", json=_rest_body(name, batch=1), timeout=30)
            assert r.status_code == 200, r.text
        with path.open("rb", buffering=0) as file:
            y = np.frombuffer(os.pread(file.fileno(), 16, offset + 32), np.float32)
        assert y.tolist() == (a * 2 + b).ravel().tolist()
        assert _mappings(server.pid, path) == []
    finally:
        _unregister(server, name, grpc=grpc)
    assert _descriptors(server.pid, path) == []


def test_a_region_past_what_a_file_can_hold_is_a_400_naming_the_offset(server: Server, key: str) -> None:
    region_file(SHM, key, 64)
    r = httpx.post(f"{server.url}/v2/systemsharedmemory/region/huge/register",
                   json={"key": key, "offset": 2**62, "byte_size": 64}, timeout=30)
    assert r.status_code == 400 and "offset" in r.json()["error"], r.text
    r = httpx.post(f"{server.url}/v2/systemsharedmemory/region/huge/register",
                   json={"key": key, "offset": 2**61, "byte_size": 64}, timeout=30)
    assert r.status_code == 400 and f"is past the end of {key!r} (64 bytes)" in r.json()["error"], r.text
    _assert_serving(server)


# ------------------------------------------------------------------ unregistered and registered again in use
def test_no_descriptor_or_mapping_outlives_a_region_registered_again_while_requests_use_it(
        server: Server, key: str) -> None:
    """The issue's race: four clients (REST and gRPC) infer through a region that is unregistered and registered
    again, over both protocols, many times; once it is unregistered for good, the server holds nothing of its
    file."""
    size = 3 * TENSOR
    path = region_file(SHM, key, size)
    name = f"again-{uuid4().hex[:6]}"
    _register(server, name, key, size)
    gone = f"unable to find shared memory region: {name!r}"
    with Hammer(server, name, lambda text: text.endswith(gone)) as hammer:
        for cycle in range(120):
            _unregister(server, name, grpc=cycle % 2 == 1)
            _register(server, name, key, size, grpc=cycle % 3 == 1)
    _unregister(server, name)
    assert hammer.problems == [], hammer.problems[:5]
    assert hammer.counts["ok"] > 0, hammer.counts
    assert _descriptors(server.pid, path) == [] and _mappings(server.pid, path) == []
    _assert_serving(server)
