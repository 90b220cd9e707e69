"""Triton's protocol extensions over REST: statistics, the model repository, and clear refusals of the
extensions this server does not implement (trace, logging).

Spoken as Triton speaks them, so ``tritonclient.http``'s ``get_inference_statistics``,
``get_model_repository_index``, ``load_model`` and ``unload_model`` work unchanged:

* ``GET /v2/models/stats``, ``/v2/models/{name}/stats``, ``/v2/models/{name}/versions/{v}/stats``:
  ``{"model_stats": [...]}`` (``registry.statistics`` says what each figure counts).
* ``POST /v2/repository/index`` (body optional: ``{"ready": true}`` lists only ready versions): a JSON list
  of ``{"name", "version", "state", "reason"}``.
* ``POST /v2/repository/models/{name}/load`` and ``.../unload``: the admin token, like every management call;
  ``registry.repository`` says what unloading means.
* Trace and logging: 400 "... is not supported by this server", never a bare 404 (the paths are kept out of
  the OpenAPI document: there is nothing to call). The shared-memory extensions live in ``shm``.

This router is included before ``v2``'s, so ``/v2/models/stats`` is not read as the metadata of a model
named "stats".
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from service.dataplane import not_supported

from .auth import require_admin
from .bodies import read_body
from .codecs import json_response, loads, validate
from .deps import dataplane_of
from .schemas import ErrorBody, RepositoryIndexRequest, RepositoryModelRequest, json_body

router = APIRouter(tags=["kserve-v2 extensions"])

MAX_BODY = 64 * 1024
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 404)}
_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 422, 503)
}


async def _optional_json(request: Request, model: type, what: str) -> Any:
    body = await read_body(request, MAX_BODY, what)
    return validate(model, loads(body, what) if body.strip() else {}, what)


# ------------------------------------------------------------------ statistics
@router.get("/v2/models/stats", summary="Inference statistics of every model version")
async def all_statistics(request: Request) -> Response:
    return json_response(dataplane_of(request).statistics())


@router.get("/v2/models/{name}/stats", summary="Inference statistics of one model", responses=_ERRORS)
async def model_statistics(request: Request, name: str) -> Response:
    return json_response(dataplane_of(request).statistics(name))


@router.get(
    "/v2/models/{name}/versions/{version}/stats", summary="Inference statistics of one version", responses=_ERRORS
)
async def version_statistics(request: Request, name: str, version: str) -> Response:
    return json_response(dataplane_of(request).statistics(name, version))


# ------------------------------------------------------------------ repository
@router.post(
    "/v2/repository/index",
    summary="Every stored model version and its state",
    responses=_ERRORS,
    openapi_extra=json_body(RepositoryIndexRequest),
)
async def repository_index(request: Request) -> Response:
    body = await _optional_json(request, RepositoryIndexRequest, "repository index request")
    return json_response(await dataplane_of(request).repository_index(body.ready))


@router.post(
    "/v2/repository/models/{name}/load",
    summary="Load a stored model (again): every version it has in the store",
    dependencies=[Depends(require_admin)],
    responses=_ADMIN_ERRORS,
    openapi_extra=json_body(RepositoryModelRequest),
)
async def load_model(request: Request, name: str) -> Response:
    body = await _optional_json(request, RepositoryModelRequest, "load request")
    await dataplane_of(request).load_model(name, body.parameters)
    return json_response({"name": name, "loaded": True})


@router.post(
    "/v2/repository/models/{name}/unload",
    summary="Unload a model: in-flight requests finish, the files stay in the store",
    dependencies=[Depends(require_admin)],
    responses=_ADMIN_ERRORS,
    openapi_extra=json_body(RepositoryModelRequest),
)
async def unload_model(request: Request, name: str) -> Response:
    await _optional_json(request, RepositoryModelRequest, "unload request")  # unload_dependents: no ensembles
    await dataplane_of(request).unload_model(name)
    return json_response({"name": name, "unloaded": True})


# ------------------------------------------------------------------ not supported
def _refusal(extension: str) -> Any:
    async def refuse() -> Response:
        raise not_supported(extension)

    return refuse


for _path, _extension in (
    ("/v2/trace/setting", "trace"),
    ("/v2/models/{name}/trace/setting", "trace"),
    ("/v2/logging", "logging"),
):
    router.add_api_route(_path, _refusal(_extension), methods=["GET", "POST"], include_in_schema=False)
