"""Upload rule for image models: a ``preprocess`` and ``postprocess`` config must fit the uploaded model.

Checked in the optimizer child (``sandbox``) against the uploaded model's own signature, before anything is
optimized; a misfit refuses the upload (UnprocessableError, 422) with a message naming the input or output:

- ``preprocess``: the model has exactly one input, the image input. With ``wire_dtype`` uint8 and a float
  input, the normalisation is folded into the graph (``fold_input_normalization``), which takes a float
  NCHW input: its rank, 3 channels and spatial size (where fixed) must match the preprocessing's output; the
  served input then becomes uint8 in ``layout``. A model whose input already is of the wire dtype takes the
  images as they are, in ``layout``. A float32 wire needs a float32 input (the server sends float32).
- ``postprocess`` labels: one per class of the classifier output, the model's first output (``[N, C]`` or
  ``[N, C, 1, 1]``, a fixed class count).
"""

from __future__ import annotations

import numpy as np

from service.errors import BadRequestError, UnprocessableError
from service.imaging.config import Preprocess, class_count
from service.optimizer.passes.fold_input_normalization import InputNormalization
from service.runtime.contract import Signature, TensorSpec

_WIRE = {"uint8": np.dtype(np.uint8), "float32": np.dtype(np.float32)}


def image_normalization(signature: Signature, preprocess: Preprocess | None) -> InputNormalization | None:
    """The normalisation to fold into the served graph (None: nothing to fold); UnprocessableError when
    ``preprocess`` does not fit the model's input."""
    if preprocess is None:
        return None
    if len(signature.inputs) != 1:
        raise UnprocessableError(
            f"preprocess: an image model has one input (the image); this one has {len(signature.inputs)}: "
            f"{signature.input_names}"
        )
    spec = signature.inputs[0]
    wire = _WIRE[preprocess.wire_dtype]
    fold = preprocess.wire_dtype == "uint8" and spec.dtype.kind == "f"
    if not fold and spec.dtype != wire:
        raise UnprocessableError(
            f"preprocess: image input {spec.name!r} is {spec.datatype}, but wire_dtype {preprocess.wire_dtype} "
            f"sends {preprocess.wire_dtype}" + (" (use wire_dtype uint8)" if spec.dtype.kind == "f" else "")
        )
    # The fold reads a float NCHW input and serves it in ``layout``; otherwise the input already is in it.
    expected = preprocess.model_copy(update={"layout": "NCHW"}) if fold else preprocess
    _check_input(expected, spec)
    return preprocess.input_normalization(spec.name) if fold else None


def check_labels(signature: Signature, label_count: int | None) -> None:
    """UnprocessableError unless ``label_count`` labels fit the classes of the model's first output."""
    if label_count is None:
        return
    output = signature.outputs[0]
    classes = class_count(output.shape)
    if classes is None:
        raise UnprocessableError(
            f"postprocess: {label_count} labels given, but output {output.name!r} (shape "
            f"{output.kserve_shape()}) has no fixed class count"
        )
    if classes != label_count:
        raise UnprocessableError(
            f"postprocess: {label_count} labels given, but output {output.name!r} has {classes} classes "
            f"(shape {output.kserve_shape()})"
        )


def _check_input(preprocess: Preprocess, spec: TensorSpec) -> None:
    try:
        preprocess.check_model_input(spec.name, spec.shape)
    except BadRequestError as exc:
        raise UnprocessableError(f"preprocess: {exc.message}") from None
