"""``inference.GRPCInferenceService``: every RPC a thin codec around ``service.dataplane``.

Behaviour is REST's, call for call: the same lookups, checks, batching, limits, admin token (the
``authorization`` metadata, "Bearer <token>", for repository load and unload), metrics (``protocol="grpc"``),
statistics and error texts, mapped to gRPC status codes (``errors``). Specifics of the protocol:

* ``ModelReady`` answers ``ready: false`` for a model that is unknown or not ready (what ``tritonclient.http``'s
  ``is_model_ready`` returns for REST's 404 and 503); a malformed name is INVALID_ARGUMENT.
* ``ModelStreamInfer`` runs the requests of one stream concurrently (at most ``STREAM_IN_FLIGHT`` at once:
  beyond, the stream is not read until one is answered) and answers each as it finishes; a failed request is
  answered in the stream with ``error_message`` and its ``id`` and the stream goes on, as Triton does. The
  client matches answers by ``id``. When the client cancels or the call ends, every request still queued is
  cancelled, which frees its place in the batching queue.
* A cancelled unary call cancels its handler, and so its place in the batching queue, the same way.
* The shared-memory RPCs are REST's routes (``api.shm``) call for call, the caller's address from
  ``context.peer()`` (``ipv4:``, ``ipv6:`` or ``unix:``); trace and logging answer UNIMPLEMENTED with REST's
  "not supported" text.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from service.dataplane import DataPlane, classified, not_supported
from service.errors import ModelNotReadyError, NotFoundError, ServiceError
from service.image_requests import image_input_name
from service.shared_memory.table import SharedMemory

from . import codecs
from .errors import abort, message_of
from .messages import pb, pb_grpc

STREAM_IN_FLIGHT = 256
"""Requests of one stream being served at once."""

Handler = Callable[..., Awaitable[Any]]


def _answers(method: Handler) -> Handler:
    """Errors of a unary RPC become its status (``errors.abort``)."""

    @functools.wraps(method)
    async def rpc(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except Exception as exc:  # asyncio.CancelledError (a BaseException) passes
            await abort(context, exc)

    return rpc


def _unsupported(extension: str) -> Handler:
    async def rpc(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, not_supported(extension))

    return rpc


def peer_address(peer: str) -> str | None:
    """The IP address in gRPC's ``context.peer()`` (``ipv4:127.0.0.1:5000``, ``ipv6:%5B::1%5D:5000``); None for a
    Unix socket (``unix:...``); anything else as it came (no address: refused where an address is asked for)."""
    scheme, _, rest = urllib.parse.unquote(peer).partition(":")
    if scheme in ("unix", "unix-abstract"):
        return None
    if scheme in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    return peer


def _region_status(kind: str, response: Any) -> Handler:
    """Triton's ``{System,Cuda}SharedMemoryStatus``: the dataplane's regions of ``kind`` as its map."""

    async def rpc(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        regions = self.regions(context, kind).status(kind, request.name)
        return response(regions={r["name"]: response.RegionStatus(**r) for r in regions})

    return _answers(rpc)


def _region_unregister(kind: str, response: Any) -> Handler:
    """Triton's ``{System,Cuda}SharedMemoryUnregister`` (closing a CUDA region is a CUDA call: off the loop)."""

    async def rpc(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await asyncio.to_thread(self.regions(context, kind).unregister, kind, request.name)
        return response()

    return _answers(rpc)


def _version(text: str) -> str | None:
    return text or None


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    # ------------------------------------------------------------------ health and metadata
    @_answers
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    @_answers
    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self.dataplane.ready)

    @_answers
    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self.dataplane.model_ready(request.name, _version(request.version))
        except (NotFoundError, ModelNotReadyError):
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    @_answers
    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerMetadataResponse(**self.dataplane.server_metadata())

    @_answers
    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return codecs.model_metadata(self.dataplane.model_metadata(request.name, _version(request.version)))

    @_answers
    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return codecs.model_config(self.dataplane.model_config(request.name, _version(request.version)))

    # ------------------------------------------------------------------ inference
    async def _infer(self, request: Any, endpoint: str) -> Any:
        """One request through the dataplane, traced (in flight, metrics, statistics)."""
        dataplane = self.dataplane
        trace = dataplane.trace("grpc", endpoint)
        outcome = "internal_error"
        try:
            mv = dataplane.model_for_infer(request.model_name, _version(request.model_version))
            trace.resolved(mv)
            with dataplane.regions() as regions:  # the request's shared-memory regions, leased until answered
                decoded = codecs.decode_infer(request, mv.signature, image_input_name(mv), regions)
                checked = decoded.request
                if checked is None:  # encoded images (a BYTES tensor): decoded off the loop
                    assert decoded.images is not None
                    checked = await dataplane.image_request(mv, decoded.images, decoded.outputs)
                trace.submitting(checked)
                result = await dataplane.infer(mv, checked, alone=dataplane.inflight.alone())
                trace.done(result)
                outputs = result.outputs
                if decoded.classification:
                    outputs = classified(mv, outputs, decoded.classification)
                placed = await regions.write_outputs(outputs) if regions.outputs else None
            response = codecs.encode_infer(mv.name, mv.version, request.id, outputs, placed)
            outcome = "success"
            return response
        except ServiceError as exc:
            outcome = exc.code
            raise
        except asyncio.CancelledError:
            outcome = "disconnected"
            raise
        finally:
            trace.finish(outcome)

    @_answers
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._infer(request, "v2_infer")

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        stream = _Stream(self)
        async for answer in stream.serve(requests):
            yield answer

    async def stream_answer(self, request: Any) -> Any:
        """One request of a stream: its response, or its error in ``error_message`` with the request's ``id``
        in an otherwise empty ``infer_response`` (as Triton answers), so the client knows which one failed."""
        try:
            return pb.ModelStreamInferResponse(infer_response=await self._infer(request, "v2_stream_infer"))
        except Exception as exc:
            return pb.ModelStreamInferResponse(error_message=message_of(exc),
                                               infer_response=pb.ModelInferResponse(id=request.id))

    # ------------------------------------------------------------------ extensions
    @_answers
    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return codecs.statistics(self.dataplane.statistics(request.name or None, _version(request.version)))

    @_answers
    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return codecs.repository_index(await self.dataplane.repository_index(request.ready))

    @_answers
    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.dataplane.check_admin(_authorization(context))
        await self.dataplane.load_model(request.model_name, codecs.parameters(request.parameters))
        return pb.RepositoryModelLoadResponse()

    @_answers
    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.dataplane.check_admin(_authorization(context))
        await self.dataplane.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ------------------------------------------------------------------ shared memory (service.shared_memory)
    def regions(self, context: grpc.aio.ServicerContext, kind: str) -> SharedMemory:
        """The server's regions, once the caller may make a ``kind`` call (``SharedMemory.check_caller``)."""
        regions = self.dataplane.shared_memory
        regions.check_caller(kind, peer_address(context.peer()))
        return regions

    SystemSharedMemoryStatus = _region_status("system", pb.SystemSharedMemoryStatusResponse)
    SystemSharedMemoryUnregister = _region_unregister("system", pb.SystemSharedMemoryUnregisterResponse)
    CudaSharedMemoryStatus = _region_status("cuda", pb.CudaSharedMemoryStatusResponse)
    CudaSharedMemoryUnregister = _region_unregister("cuda", pb.CudaSharedMemoryUnregisterResponse)

    @_answers
    async def SystemSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        regions = self.regions(context, "system")
        regions.register_system(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_answers
    async def CudaSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        regions = self.regions(context, "cuda")
        await asyncio.to_thread(regions.register_cuda, request.name, request.raw_handle, request.device_id,
                                request.byte_size)  # opening the handle is a CUDA call
        return pb.CudaSharedMemoryRegisterResponse()

    TraceSetting = _unsupported("trace")
    LogSettings = _unsupported("logging")


class _Stream:
    """The requests of one ``ModelStreamInfer`` call, served concurrently, answered as they finish."""

    def __init__(self, servicer: Servicer) -> None:
        self.servicer = servicer
        self.slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
        self.answers: asyncio.Queue[Any] = asyncio.Queue()
        self.pending: set[asyncio.Task[Any]] = set()
        self.read_all = False

    async def serve(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        reader = asyncio.create_task(self._read(requests), name="grpc-stream-read")
        try:
            while not (self.read_all and not self.pending and self.answers.empty()):
                answer = await self.answers.get()
                if answer is None:  # the reader ended
                    continue
                self.slots.release()
                yield answer
            await reader  # a failure to read the stream ends the call with it
        finally:
            reader.cancel()
            for task in self.pending:
                task.cancel()  # a cancelled stream frees its requests' places in the batching queue
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                await self.slots.acquire()
                task = asyncio.create_task(self.servicer.stream_answer(request))
                self.pending.add(task)
                task.add_done_callback(self._answered)
        finally:
            self.read_all = True
            self.answers.put_nowait(None)

    def _answered(self, task: asyncio.Task[Any]) -> None:
        self.pending.discard(task)
        if not task.cancelled():
            self.answers.put_nowait(task.result())
