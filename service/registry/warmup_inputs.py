"""The requests a version serves itself before any client (``ModelVersion.activate``): inputs its original ran on.

Why: a model may fail on some values (a detector's value-dependent Reshape failed on zeros: torchvision's Mask
R-CNN answered its upload with a 500 although verification had run it on other inputs). So the warm-up takes the
input kinds verification fed the original and it ran on (the report's ``verify_input_kinds``:
``optimizer.verify_inputs``), in that order, then zeros; the first that runs warms the path, and a failure costs
only that input. Batch 1 where the batch is free; only where every non-batch dim is fixed (else no safe shape is
known, and nothing is served before a client).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.optimizer.verify_inputs import INPUT_KINDS, InputSpec, random_feeds
from service.runtime.contract import InferenceRequest, Signature


def warmup_requests(signature: Signature, report: Mapping[str, Any] | None) -> list[InferenceRequest]:
    """Requests to warm the path with, the likeliest to run first (see the module docstring)."""
    if not signature.fixed_shapes:
        return []
    kinds = _verified_kinds(report)
    specs = [InputSpec(s.name, s.dtype.type, (s.shape[0] or 1, *s.shape[1:])) for s in signature.inputs]
    requests = [signature.request(random_feeds(specs, 1, np.random.default_rng(0), kind)) for kind in kinds]
    zeros = {s.name: np.zeros((s.shape[0] or 1, *s.shape[1:]), s.dtype) for s in signature.inputs}
    return [*requests, signature.request(zeros)]


def kinds_tried(report: Mapping[str, Any] | None) -> Sequence[str]:
    """What the warm-up inputs were, for a message: the verified kinds, then zeros."""
    return [*_verified_kinds(report), "zeros"]


def _verified_kinds(report: Mapping[str, Any] | None) -> list[str]:
    """The input kinds the optimizer verified the model on (the ones this server can draw)."""
    return [k for k in (report or {}).get("verify_input_kinds") or () if k in INPUT_KINDS]


__all__ = ["kinds_tried", "warmup_requests"]
