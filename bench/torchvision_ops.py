"""torchvision's operators when its compiled library cannot load (the export sweep's torch venv only).

Why: PyPI's torchvision wheels are built against the CUDA build of torch (their ``_C.so`` links
``libtorch_cuda.so``), so beside the CPU-only torch wheel ``import torchvision`` stops with "operator
torchvision::nms does not exist". The exporters never run these kernels into the graph: TorchScript
writes a registered symbolic for the ``torchvision::nms`` / ``torchvision::roi_align`` call and dynamo
translates the same call (onnxscript's torchlib), so registering the operators under their real schemas
with Python kernels yields the graph the compiled library would. The kernels only feed tracing.

``ensure()`` must run before the first ``import torchvision``; it does nothing when the compiled
library loads, and says which way it went.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

# Schemas as torchvision's csrc/ops/*.cpp declare them: the detection models call nms and roi_align only;
# qnms is declared (no kernel) because torchvision registers a fake kernel for it on import.
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
)
_LIBRARY: list = []  # keeps the torch.library.Library alive: dropping it unregisters the operators


def ensure() -> str:
    """Make ``torch.ops.torchvision.nms``/``roi_align`` callable: "native" or "python (<why>)"."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return "missing"
    library = Path(next(iter(spec.submodule_search_locations))) / "_C.so"
    try:
        torch.ops.load_library(str(library))
        return "native"
    except OSError:
        why = _load_error(library)
    _define(torch)
    _mark_ops_available()
    return f"python ({why})"


def _load_error(library: Path) -> str:
    """The dynamic loader's reason (torch's own message names only the path)."""
    import ctypes

    try:
        ctypes.CDLL(str(library))
    except OSError as exc:
        return str(exc).split(library.parent.as_posix())[-1].strip(" /")
    return "torch.ops.load_library failed"


def _define(torch) -> None:
    """Declare the schemas with Python CPU kernels and fake (shape-only) kernels for torch.export."""
    lib = torch.library.Library("torchvision", "DEF")
    _LIBRARY.append(lib)
    for schema in _SCHEMAS:
        lib.define(schema)
    lib.impl("nms", _nms, "CPU")
    lib.impl("roi_align", _roi_align, "CPU")
    # torchvision registers nms's fake kernel itself (unconditionally); roi_align's only with its library.
    torch.library.register_fake("torchvision::roi_align", _roi_align_fake, lib=lib)


def _mark_ops_available() -> None:
    """Point torchvision's ``_has_ops`` checks at the operators just defined (imports torchvision)."""
    # importlib: ``torchvision.ops.roi_align`` as an attribute is the function, which shadows its module
    for module in ("torchvision.extension", "torchvision.ops.roi_align"):
        importlib.import_module(module)._has_ops = _has_ops


def _has_ops() -> bool:
    """A plain function, not a lambda: torch.jit scripts it where torchvision's NMS helpers are scripted."""
    return True


def _nms(dets, scores, iou_threshold: float):
    """Greedy non-maximum suppression: indices of the kept boxes, highest score first."""
    import torch

    order = torch.argsort(scores, descending=True, stable=True)
    x1, y1, x2, y2 = dets.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    suppressed = torch.zeros(dets.shape[0], dtype=torch.bool)
    keep = []
    for i in order.tolist():
        if suppressed[i]:
            continue
        keep.append(i)
        w = (torch.minimum(x2[i], x2) - torch.maximum(x1[i], x1)).clamp(min=0)
        h = (torch.minimum(y2[i], y2) - torch.maximum(y1[i], y1)).clamp(min=0)
        inter = w * h
        suppressed |= inter / (areas[i] + areas - inter) > iou_threshold
    return torch.tensor(keep, dtype=torch.long)


def _roi_align(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    """torchvision's own pure-PyTorch RoIAlign (the one it uses under torch.compile)."""
    from torchvision.ops.roi_align import _roi_align

    return _roi_align(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)


def _roi_align_fake(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    return input.new_empty((rois.size(0), input.size(1), pooled_height, pooled_width))
