"""Reading and writing model files with clear errors (no tracebacks for bad files)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from service.errors import InvalidModelError


def parse_model_bytes(data: bytes) -> onnx.ModelProto:
    """Parse a serialized ModelProto; raise InvalidModelError for anything that is not one."""
    if not data:
        raise InvalidModelError("the file is empty")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InvalidModelError(f"not an ONNX model: protobuf parse failed ({type(exc).__name__})") from exc
    if not model.HasField("graph") or not model.opset_import:
        raise InvalidModelError("not an ONNX model: no graph or no opset import")
    return model


def load_model_file(path: Path) -> onnx.ModelProto:
    """Read a model file. Weights stored beside it (external data) are never loaded: a model must not make
    the service open any file it names (``registry.acceptance`` refuses such models)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidModelError(f"cannot read {path.name}: {exc.strerror}") from exc
    return parse_model_bytes(data)


def save_model_file(model: onnx.ModelProto, path: Path) -> None:
    """Write atomically: temp file in the same folder, fsync, rename. The file is readable like any other
    the user writes (0644 less the umask), not private as ``tempfile.mkstemp`` would make it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(model.SerializeToString())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
