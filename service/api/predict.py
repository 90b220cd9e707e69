"""``POST /predict``: the simple JSON endpoint (and raw ``.npy`` for single-input models).

JSON in: ``{"model"?, "version"?, "inputs": {name: nested list}}``; JSON out: ``{"model", "version",
"outputs": {name: nested list}}``. The body is read and decoded by hand with orjson (FastAPI's pydantic
path would walk every number of a 600k-value image batch); the pydantic model still validates the
structure and documents it in OpenAPI.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from service.dataplane import version_number
from service.errors import BadRequestError, UnsupportedMediaTypeError
from service.runtime.contract import TensorSpec

from .bodies import MIB, read_body
from .codecs import NPY_MEDIA_TYPE, arrays_from_nested, decode_npy, decode_predict, dumps, encode_npy
from .codecs import outputs_payload as jsonable_outputs
from .deps import dataplane_of, settings_of
from .inference import Observed, infer
from .schemas import ErrorBody, PredictRequest, PredictResponse, json_body

router = APIRouter(tags=["inference"])

_ERRORS = {code: {"model": ErrorBody} for code in (400, 404, 413, 415, 503, 504)}
_OPENAPI = json_body(PredictRequest)
_OPENAPI["requestBody"]["content"][NPY_MEDIA_TYPE] = {"schema": {"type": "string", "format": "binary"}}


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _is_json(media: str) -> bool:
    return media in ("", "application/json") or media.endswith("+json")


@router.post(
    "/predict",
    summary="Run a model on JSON (or .npy) inputs",
    response_model=PredictResponse,
    responses=_ERRORS,
    openapi_extra=_OPENAPI,
)
async def predict(
    request: Request,
    model: Annotated[str | None, Query(max_length=64, description="Model, if the body has none")] = None,
    version: Annotated[str | None, Query(max_length=20, description="Version (default: the latest)")] = None,
) -> Response:
    async with Observed(request, "predict") as obs:
        media = _media_type(request)
        if not _is_json(media) and media != NPY_MEDIA_TYPE:
            raise UnsupportedMediaTypeError(f"send application/json or {NPY_MEDIA_TYPE}, not {media[:64]!r}")
        settings = settings_of(request)
        body = await read_body(request, settings.max_request_mb * MIB, timeout_s=settings.request_timeout_s)
        dataplane = dataplane_of(request)
        if media == NPY_MEDIA_TYPE:
            mv = dataplane.model_for_infer(model, version)
            spec = _single_input(mv.signature.inputs)
            inputs = {spec.name: _npy_input(body, spec.dtype)}
        else:
            req = decode_predict(body)
            number = version if req.version is None else version_number(req.version)
            mv = dataplane.model_for_infer(req.model or model, number)
            inputs = arrays_from_nested(req.inputs, mv.signature)
        obs.model = mv.name
        obs.result = await infer(request, mv, mv.signature.request(inputs))
        if NPY_MEDIA_TYPE in request.headers.get("accept", "") and len(obs.result.outputs) == 1:
            (array,) = obs.result.outputs.values()
            return Response(encode_npy(array), media_type=NPY_MEDIA_TYPE)
        doc = {"model": mv.name, "version": mv.version, "outputs": jsonable_outputs(obs.result.outputs)}
        return Response(dumps(doc), media_type="application/json")


def _single_input(specs: tuple[TensorSpec, ...]) -> TensorSpec:
    if len(specs) != 1:
        raise BadRequestError(f"{NPY_MEDIA_TYPE} bodies need a single-input model; this takes {len(specs)}")
    return specs[0]


def _npy_input(body: bytes, dtype: np.dtype) -> np.ndarray:
    """Decode a .npy body; float64 from a plain ``np.save`` is cast to the model's float32 and the like."""
    arr = decode_npy(body)
    if arr.dtype != dtype and np.can_cast(arr.dtype, dtype, casting="same_kind"):
        arr = arr.astype(dtype)
    return arr
