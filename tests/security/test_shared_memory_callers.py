"""Who may register, list and unregister shared-memory regions: a client on this host (a loopback address or a
Unix socket), unless ``SERVICE_SHARED_MEMORY_REMOTE`` is on; and the register body's sizes are JSON integers.

REST through the real app in-process, its client on another address (``httpx.ASGITransport(client=...)``: a
server in a test binds loopback only); gRPC through the real servicer over the same app's dataplane, the peer
given by the call's context as gRPC writes it (``ipv4:``, ``ipv6:%5B...%5D:``, ``unix:``). Every route of the
extensions is found by walking the app's route table, every RPC by the service's descriptor, so a new one cannot
slip through.
"""

from __future__ import annotations

import base64
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import grpc
import httpx
import pytest
from inprocess import make_settings, serve_app
from shm_kit import region_file

from service.errors import ForbiddenError
from service.grpc.messages import pb
from service.grpc.servicer import Servicer, peer_address
from service.shared_memory.callers import check_caller, on_this_host

pytestmark = pytest.mark.anyio

REMOTE = ("203.0.113.7", 40000)
REFUSED = re.compile(r"^shared-memory register, unregister and status calls are taken only from clients on this "
                     r"server's host \(a loopback address or a Unix socket\), not from 203\.0\.113\.7: shared memory "
                     r"works only there; SERVICE_SHARED_MEMORY_REMOTE=true lets any client make them$")
BODIES = {"system": {"key": "/k", "offset": 0, "byte_size": 8},
          "cuda": {"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": 0, "byte_size": 8}}


@pytest.mark.parametrize("peer", [None, "127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1", "::1%lo"])
def test_loopback_addresses_and_unix_sockets_are_on_this_host(peer: str | None) -> None:
    assert on_this_host(peer)
    check_caller(peer, remote=False)


@pytest.mark.parametrize("peer", ["203.0.113.7", "10.0.0.1", "192.168.1.2", "0.0.0.0", "::", "fe80::1%eth0",
                                  "::ffff:10.0.0.1", "2001:db8::1", "", "localhost", "ipv4:127.0.0.1:5"])
def test_other_addresses_and_what_is_no_address_are_not(peer: str) -> None:
    assert not on_this_host(peer)
    with pytest.raises(ForbiddenError, match="SERVICE_SHARED_MEMORY_REMOTE=true lets any client make them"):
        check_caller(peer, remote=False)
    check_caller(peer, remote=True)  # the operator's opt-in


@pytest.mark.parametrize(("peer", "address"), [
    ("ipv4:127.0.0.1:40588", "127.0.0.1"), ("ipv6:%5B::1%5D:43234", "::1"), ("ipv6:[::1]:43234", "::1"),
    ("ipv4:203.0.113.7:1", "203.0.113.7"), ("unix:", None), ("unix:/run/x.sock", None), ("unix-abstract:x", None),
    ("vsock:3:5", "vsock:3:5"), ("", ""),
])
def test_the_grpc_peer_gives_its_address(peer: str, address: str | None) -> None:
    assert peer_address(peer) == address


# ------------------------------------------------------------------ REST
def _shared_memory_routes(routes: list[Any]) -> list[tuple[str, str]]:
    """(method, path) of every route of the two extensions, from the app's route table (looking into included
    routers, which FastAPI >= 0.16x wraps)."""
    found = []
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            found += _shared_memory_routes(included.routes)
        elif re.match(r"^/v2/(system|cuda)sharedmemory/", getattr(route, "path", "")):
            found += [(method, route.path.replace("{name}", "r")) for method in route.methods - {"HEAD"}]
    return sorted(set(found))


@pytest.fixture(scope="module")
async def remote(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    """The app, its client on a documentation address (another host)."""
    async with serve_app(make_settings(tmp_path_factory.mktemp("remote")), peer=REMOTE) as client:
        yield client


async def test_every_shared_memory_route_refuses_a_client_of_another_host(remote: httpx.AsyncClient) -> None:
    routes = _shared_memory_routes(remote.app.routes)  # type: ignore[attr-defined]
    assert len(routes) == 10, routes  # status, one status, register, unregister all, unregister one; two kinds
    for method, path in routes:
        body = BODIES["cuda" if "cuda" in path else "system"] if path.endswith("/register") else None
        r = await remote.request(method, path, json=body)
        assert r.status_code == 403, (method, path, r.text)
        assert REFUSED.match(r.json()["error"]), r.json()["error"]
    r = await remote.get("/v2")  # the rest of the server answers that client
    assert r.status_code == 200 and "system_shared_memory" in r.json()["extensions"]


async def test_the_setting_lets_a_client_of_another_host_make_the_calls(tmp_path: Path) -> None:
    key = f"/onnxcnn-test-remote-{uuid4().hex[:8]}"
    path = region_file(Path("/dev/shm"), key, 64)
    try:
        async with serve_app(make_settings(tmp_path, shared_memory_remote=True), peer=REMOTE) as client:
            r = await client.post("/v2/systemsharedmemory/region/r/register", json={"key": key, "byte_size": 64})
            assert r.status_code == 200, r.text
            r = await client.get("/v2/systemsharedmemory/status")
            assert r.status_code == 200 and [s["name"] for s in r.json()] == ["r"], r.text
            r = await client.post("/v2/systemsharedmemory/unregister")
            assert r.status_code == 200, r.text
    finally:
        path.unlink()


@pytest.fixture(scope="module")
async def local(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_app(make_settings(tmp_path_factory.mktemp("local"))) as client:
        yield client


@pytest.mark.parametrize(("field", "value"), [("byte_size", "8"), ("byte_size", 8.0), ("byte_size", True),
                                              ("offset", "0"), ("offset", 0.0), ("offset", False)])
async def test_register_sizes_must_be_json_integers(local: httpx.AsyncClient, field: str, value: object) -> None:
    key = f"/onnxcnn-test-strict-{uuid4().hex[:8]}"
    path = region_file(Path("/dev/shm"), key, 64)
    try:
        r = await local.post("/v2/systemsharedmemory/region/r/register",
                             json={"key": key, "offset": 0, "byte_size": 8, field: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == f"invalid system shared memory register request: {field}: Input should be a " \
                                    "valid integer"
        assert (await local.get("/v2/systemsharedmemory/status")).json() == []
    finally:
        path.unlink()


@pytest.mark.parametrize(("field", "value"), [("byte_size", "8"), ("byte_size", 8.5), ("device_id", True),
                                              ("device_id", "0")])
async def test_cuda_register_sizes_must_be_json_integers(local: httpx.AsyncClient, field: str, value: object) -> None:
    r = await local.post("/v2/cudasharedmemory/region/g/register", json={**BODIES["cuda"], field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(f"invalid CUDA shared memory register request: {field}: Input should be a "
                                        "valid integer")


# ------------------------------------------------------------------ gRPC
class _Aborted(Exception):
    pass


class _Context:
    """A servicer context with the given peer; ``abort`` raises, as grpc.aio's does, keeping code and details."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str, metadata: Any = ()) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)


def _shared_memory_rpcs() -> list[str]:
    """Every shared-memory RPC of the KServe V2 service (its descriptor)."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    return sorted(m.name for m in service.methods if "SharedMemory" in m.name)


def _request(rpc: str) -> Any:
    request = getattr(pb, f"{rpc}Request")()
    if rpc == "SystemSharedMemoryRegister":
        request.name, request.key, request.byte_size = "r", "/k", 8
    elif rpc == "CudaSharedMemoryRegister":
        request.name, request.raw_handle, request.byte_size = "g", bytes(64), 8
    return request


async def test_every_shared_memory_rpc_refuses_a_client_of_another_host(remote: httpx.AsyncClient) -> None:
    servicer = Servicer(remote.app.state.dataplane)  # type: ignore[attr-defined]
    rpcs = _shared_memory_rpcs()
    assert len(rpcs) == 6, rpcs
    for rpc in rpcs:
        context = _Context("ipv4:203.0.113.7:40000")
        with pytest.raises(_Aborted):
            await getattr(servicer, rpc)(_request(rpc), context)
        assert context.code == grpc.StatusCode.PERMISSION_DENIED, (rpc, context.code, context.details)
        assert REFUSED.match(context.details), context.details


@pytest.mark.parametrize("peer", ["ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000", "unix:"])
async def test_grpc_clients_on_this_host_make_the_calls(remote: httpx.AsyncClient, peer: str) -> None:
    servicer = Servicer(remote.app.state.dataplane)  # type: ignore[attr-defined]
    for rpc in ("SystemSharedMemoryStatus", "CudaSharedMemoryStatus", "SystemSharedMemoryUnregister"):
        await getattr(servicer, rpc)(_request(rpc), _Context(peer))
