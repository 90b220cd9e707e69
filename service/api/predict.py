"""``POST /predict``: the simple endpoint: tensors as JSON (or raw ``.npy`` for single-input models), and
encoded images for image models (uploaded with a ``preprocess`` config).

Tensors: ``{"model"?, "version"?, "inputs": {name: nested list}}`` -> ``{"model", "version", "outputs":
{name: nested list}}``. Images (JPEG or PNG, decoded against the model's preprocessing off the event loop,
see ``service.image_requests``): an ``image/*`` body (one image), a ``multipart/form-data`` body of parts
named ``image`` (a batch), or JSON ``{"model"?, "version"?, "image": base64 | "images": [base64, ...]}``
-> ``{"model", "version", "predictions": [[{"label", "index", "score"}, ...] per image]}`` for a model with
a ``postprocess`` config, its raw ``outputs`` otherwise or with ``raw`` (query ``?raw=true``, or ``"raw":
true`` in JSON). The model comes from the body, else the ``model`` query parameter, else the only one
loaded. The body is read and decoded by hand with orjson (FastAPI's pydantic path would walk every number
of a 600k-value image batch); the pydantic models still validate the structure and document it in OpenAPI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from service.dataplane import version_number
from service.errors import BadRequestError, UnsupportedMediaTypeError
from service.image_requests import check_image_count, max_images, predictions
from service.registry.version import ModelVersion
from service.runtime.contract import TensorSpec

from .bodies import MIB, read_body
from .codecs import NPY_MEDIA_TYPE, arrays_from_nested, decode_npy, dumps, encode_npy, loads, validate
from .codecs import outputs_payload as jsonable_outputs
from .deps import dataplane_of, settings_of
from .images import decode_base64, image_form_parts, is_image_media
from .inference import Observed
from .schemas import ErrorBody, PredictImagesRequest, PredictRequest, PredictResponse, json_body

router = APIRouter(tags=["inference"])

MULTIPART = "multipart/form-data"
_ERRORS = {code: {"model": ErrorBody} for code in (400, 404, 413, 415, 503, 504)}
_OPENAPI = json_body(PredictRequest)
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_OPENAPI["requestBody"]["content"]["application/json"]["schema"] = {"oneOf": [
    {"$ref": f"#/components/schemas/{m.__name__}"} for m in (PredictRequest, PredictImagesRequest)
]}  # fmt: skip
_OPENAPI["requestBody"]["content"].update({
    NPY_MEDIA_TYPE: _BINARY, "image/jpeg": _BINARY, "image/png": _BINARY,
    MULTIPART: {"schema": {"type": "object", "required": ["image"], "properties": {
        "image": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
})  # fmt: skip


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
    raw: Annotated[bool, Query(description="Images: the raw outputs instead of the top-k classes")] = False,
) -> Response:
    async with Observed(request, "predict") as obs:
        media = _media_type(request)
        if not (_is_json(media) or media in (NPY_MEDIA_TYPE, MULTIPART) or is_image_media(media)):
            raise UnsupportedMediaTypeError(
                f"send application/json, {NPY_MEDIA_TYPE}, an image (image/jpeg, image/png) or {MULTIPART} "
                f"(parts named 'image'), not {media[:64]!r}"
            )
        settings = settings_of(request)
        body = await read_body(request, settings.max_request_mb * MIB, timeout_s=settings.request_timeout_s)
        dataplane = dataplane_of(request)
        if is_image_media(media) or media == MULTIPART:
            mv = dataplane.model_for_infer(model, version)
            parts = [body] if is_image_media(media) else image_form_parts(
                body, request.headers.get("content-type", ""), max_images(mv))
            return await _predict_images(request, obs, mv, parts, raw)
        if media == NPY_MEDIA_TYPE:
            mv = dataplane.model_for_infer(model, version)
            spec = _single_input(mv.signature.inputs)
            inputs = {spec.name: _npy_input(body, spec.dtype)}
        else:
            doc = loads(body)
            if isinstance(doc, dict) and ("image" in doc or "images" in doc):
                images = validate(PredictImagesRequest, doc, "predict request")
                number = version if images.version is None else version_number(images.version)
                mv = dataplane.model_for_infer(images.model or model, number)
                texts = [images.image] if images.images is None else images.images
                check_image_count(mv, len(texts))  # before a byte is base64-decoded
                parts = [decode_base64(text, index) for index, text in enumerate(texts)]
                return await _predict_images(request, obs, mv, parts, raw or images.raw)
            req = validate(PredictRequest, doc, "predict request")
            number = version if req.version is None else version_number(req.version)
            mv = dataplane.model_for_infer(req.model or model, number)
            inputs = arrays_from_nested(req.inputs, mv.signature)
        obs.resolved(mv)
        await obs.infer(mv, mv.signature.request(inputs))
        if NPY_MEDIA_TYPE in request.headers.get("accept", "") and len(obs.result.outputs) == 1:
            (array,) = obs.result.outputs.values()
            return Response(encode_npy(array), media_type=NPY_MEDIA_TYPE)
        doc = {"model": mv.name, "version": mv.version, "outputs": jsonable_outputs(obs.result.outputs)}
        return Response(dumps(doc), media_type="application/json")


async def _predict_images(
    request: Request, obs: Observed, mv: ModelVersion, images: list[bytes], raw: bool
) -> Response:
    obs.resolved(mv)
    checked = await dataplane_of(request).image_request(mv, images)
    await obs.infer(mv, checked)
    return Response(dumps(predict_answer(mv, obs.result.outputs, raw)), media_type="application/json")


def predict_answer(mv: ModelVersion, outputs: Mapping[str, np.ndarray], raw: bool) -> dict[str, Any]:
    """The body for an image request: top-k records per image for a model with a ``postprocess`` config
    (unless ``raw``), else the raw outputs as for tensors."""
    doc: dict[str, Any] = {"model": mv.name, "version": mv.version}
    if raw or mv.config.postprocess is None:
        doc["outputs"] = jsonable_outputs(outputs)
    else:
        doc["predictions"] = predictions(mv, outputs)
    return doc


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
