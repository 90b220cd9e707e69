"""Which stored tuner record a load builds at once (``tuner.reusable``): one proven where it served, made on this GPU
model and ORT version, whose choice (and split) is still a candidate nothing refused since; wherever it is among a
version's records (replicas on different GPUs share one store, so a version carries one record per device)."""

from __future__ import annotations

import onnxruntime as ort

from service.runtime.tuner import Config, _first_reusable, reusable
from service.runtime.tuner_faults import Identity

NHWC, NCHW = Config("plain", True, "fp32", False), Config("plain", False, "fp32", False)
LARGE = Config("plain", True, "fp16", True, cuda_graph=False)
CONFIGS = [NHWC, NCHW, LARGE]
HERE = Identity("GPU X", {"plain": "a" * 64}, None)


def record(device: str, config: Config, ort_version: str = ort.__version__, *, proven: bool = True) -> dict:
    return {"choice": config.to_dict(), "device": device, "ort_version": ort_version, "timings_ms": {},
            "proven": proven}


def test_the_proven_record_of_this_device_is_found_among_others() -> None:
    theirs, old_ort, mine = record("GPU Y", NHWC), record("GPU X", NHWC, "0.0"), record("GPU X", NCHW)
    assert _first_reusable([None, theirs, old_ort, mine], HERE, CONFIGS, {}) is mine
    assert _first_reusable([theirs, old_ort], HERE, CONFIGS, {}) is None
    assert reusable(mine, HERE, CONFIGS, {}) == NCHW


def test_a_record_not_proven_where_it_served_is_not_reused() -> None:
    """The default configuration a version served before tuning, or a record the tuner made in a child only."""
    assert reusable(record("GPU X", NHWC, proven=False), HERE, CONFIGS, {}) is None
    assert reusable({**record("GPU X", NHWC), "proven": None}, HERE, CONFIGS, {}) is None


def test_a_refused_or_no_longer_allowed_choice_is_not_reused() -> None:
    mine = record("GPU X", NCHW)
    assert reusable(mine, HERE, CONFIGS, {NCHW.key: "faulted: CUDA failure 715"}) is None
    assert reusable(mine, HERE, [NHWC], {}) is None  # e.g. a precision that no longer allows it
    assert reusable({**mine, "choice": {"bogus": 1}}, HERE, CONFIGS, {}) is None


def test_a_split_is_reused_only_while_its_large_engine_is_allowed_too() -> None:
    split = {**record("GPU X", NHWC), "split": {"choice": LARGE.to_dict(), "buckets": [64]}}
    assert reusable(split, HERE, CONFIGS, {}) == NHWC
    assert reusable(split, HERE, CONFIGS, {LARGE.key: "faulted: 716"}) is None
    assert reusable(split, HERE, [NHWC], {}) is None
    no_buckets = {**split, "split": {"choice": LARGE.to_dict(), "buckets": []}}  # measured, not split
    assert reusable(no_buckets, HERE, [NHWC], {}) == NHWC
