"""Pydantic models of the request and response bodies.

They serve two purposes: the OpenAPI document (clients, schemathesis) and the structural validation of
inference request bodies after orjson has decoded them. Tensor ``data`` stays ``Any`` so pydantic never
walks a large nested list (numpy converts it once, in ``codecs``). Limits (name lengths, rank, number of
tensors) are part of the schema so a hostile body is refused before any tensor is built.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from service.dataplane import MAX_VERSION
from service.registry.acceptance import MODEL_NAME_PATTERN

MAX_RANK = 32  # numpy allows 64; no CNN tensor comes near either
MAX_TENSORS = 64  # inputs or requested outputs in one request
MAX_NAME_LEN = 256
UNNAMED = "Model name; default: the server's SERVICE_DEFAULT_MODEL while it holds it, else the only model loaded."

Dim = Annotated[StrictInt, Field(ge=0, le=2**62)]
TensorName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN)]


class ErrorBody(BaseModel):
    error: str = Field(description="What went wrong, for a human; never a path or a traceback.")


# ---------------------------------------------------------------- /predict
class PredictRequest(BaseModel):
    """``POST /predict`` JSON body."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, pattern=MODEL_NAME_PATTERN, description=UNNAMED
    )
    version: Any = Field(
        None, description="Version: a positive integer, as on every route; default: the latest.",
        json_schema_extra={"type": "integer", "minimum": 1, "maximum": MAX_VERSION},
    )
    inputs: dict[TensorName, Any] = Field(
        ..., min_length=1, max_length=MAX_TENSORS, description="Input name -> nested list, batch dim first."
    )


class PredictImagesRequest(BaseModel):
    """``POST /predict`` JSON body carrying encoded images (JPEG or PNG) for a model with a preprocess config."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, pattern=MODEL_NAME_PATTERN, description=UNNAMED
    )
    version: Annotated[StrictInt, Field(ge=1)] | None = Field(None, description="Version; default: latest.")
    image: str | None = Field(None, description="One image, base64 (standard alphabet, padded, no line breaks) "
                              "or a data:image/...;base64, URL.")
    images: list[Any] | None = Field(None, min_length=1, description="Several images (a batch), each as 'image'.")
    raw: StrictBool = Field(False, description="Return the raw outputs instead of the top-k classes.")

    @model_validator(mode="after")
    def _one_of(self) -> PredictImagesRequest:
        if (self.image is None) == (self.images is None):
            raise ValueError("give 'image' or 'images', not both")
        return self


class Prediction(BaseModel):
    label: str | None = Field(None, description="The class's label (when the model has labels).")
    index: int
    score: float = Field(description="Softmax probability (or the raw score when the model's softmax is off).")


class PredictResponse(BaseModel):
    model: str
    version: int
    outputs: dict[str, Any] | None = Field(
        None, description="Output name -> nested list, batch dimension first (tensor requests, or raw)."
    )
    predictions: list[list[Prediction]] | None = Field(
        None, description="Per image, the top-k classes, best first (image requests to a classifier)."
    )


# ---------------------------------------------------------------- KServe V2
class InferInputTensor(BaseModel):
    """One input of a V2 inference request: ``data`` (flat or nested, row-major) or binary data."""

    model_config = ConfigDict(extra="ignore")

    name: TensorName
    shape: list[Dim] = Field(..., max_length=MAX_RANK)
    datatype: str = Field(..., min_length=1, max_length=16)
    parameters: dict[str, Any] | None = None
    data: Any = None


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: TensorName
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    """KServe V2 inference request (the JSON part when the binary extension is used)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = Field(None, max_length=256)
    parameters: dict[str, Any] | None = None
    inputs: list[InferInputTensor] = Field(..., min_length=1, max_length=MAX_TENSORS)
    outputs: list[RequestedOutput] | None = Field(None, max_length=MAX_TENSORS)


class InferOutputTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferOutputTensor]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 marks a dynamic dimension.")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


# ---------------------------------------------------------------- repository extension
class RepositoryIndexRequest(BaseModel):
    """``POST /v2/repository/index`` body (optional)."""

    model_config = ConfigDict(extra="ignore")

    repository_name: str | None = Field(None, max_length=MAX_NAME_LEN, description="Ignored: one repository.")
    ready: bool = Field(False, description="Only the versions that are ready to serve.")


class RepositoryModelRequest(BaseModel):
    """``POST /v2/repository/models/{name}/load|unload`` body (optional)."""

    model_config = ConfigDict(extra="ignore")

    parameters: dict[str, Any] | None = Field(
        None, max_length=MAX_TENSORS, description="Triton's load parameters; 'config' and 'file:' overrides are "
        "refused (upload a new version instead); unload_dependents is accepted and has nothing to act on.",
    )


class SystemRegionRequest(BaseModel):
    """``POST /v2/systemsharedmemory/region/{name}/register`` body (tritonclient's
    ``register_system_shared_memory``)."""

    key: str = Field(description="The shm_open name of the client's region, e.g. '/input_data' (a file directly in "
                     "/dev/shm, owned by the server's user, writable by nobody else).", max_length=256)
    offset: StrictInt = Field(0, ge=0, description="Where the region starts in that object, in bytes (a JSON "
                              "integer).")
    byte_size: StrictInt = Field(ge=1, description="The region's size in bytes (a JSON integer).")


class RawHandle(BaseModel):
    b64: str = Field(max_length=256, description="The cudaIpcMemHandle_t, base64.")


class CudaRegionRequest(BaseModel):
    """``POST /v2/cudasharedmemory/region/{name}/register`` body (tritonclient's ``register_cuda_shared_memory``)."""

    raw_handle: RawHandle
    device_id: StrictInt = Field(ge=0, description="The GPU that holds the memory (a JSON integer).")
    byte_size: StrictInt = Field(ge=1, description="The region's size in bytes (a JSON integer).")


BODY_MODELS: tuple[type[BaseModel], ...] = (PredictRequest, PredictImagesRequest, InferRequest, RepositoryIndexRequest,
                                             RepositoryModelRequest, SystemRegionRequest, CudaRegionRequest)


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a JSON body the route reads itself (for speed) as ``model``."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }
