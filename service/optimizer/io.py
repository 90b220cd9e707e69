"""Reading and writing model files with clear errors (no tracebacks for bad files)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

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


def load_model_file(path: Path, *, external_data: bool = False) -> onnx.ModelProto:
    """Read a model file. ``external_data=True`` (the CLI, on the operator's own files) also loads weights
    stored beside it; the server never does: an uploaded model must not make it open any file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidModelError(f"cannot read {path.name}: {exc.strerror}") from exc
    model = parse_model_bytes(data)
    if external_data:
        _load_external_data(model, path.parent)
    return model


def _load_external_data(model: onnx.ModelProto, folder: Path) -> None:
    """Pull weights stored beside the file into the model (in place).

    Why: ``torch.onnx.export(dynamo=True)`` writes ``model.onnx`` plus ``model.onnx.data`` by default;
    without this every such export was refused as invalid. onnx's reader keeps each location inside
    ``folder`` (no ``..``, no symlinks) and checks offsets against the file size.
    """
    helper = external_data_helper
    tensors = [t for t in helper._get_all_tensors(model) if helper.uses_external_data(t)]
    for tensor in tensors:
        location = next((e.value for e in tensor.external_data if e.key == "location"), "?")
        try:
            external_data_helper.load_external_data_for_tensor(tensor, str(folder))
        except Exception as exc:  # missing file, path outside the folder, bad offsets: refuse, name the file
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            detail = detail.replace(str(folder), "").replace(str(folder.resolve()), "")
            raise InvalidModelError(
                f"cannot load the weights of tensor {tensor.name!r} from the external data file"
                f" {location!r} (it must lie next to the model file): {detail}"
            ) from exc


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
