"""The tuner reuses the record made on this GPU and ORT version, wherever it is among a version's records
(replicas on different GPUs share one store, so a version carries one record per device)."""

from __future__ import annotations

import onnxruntime as ort

from service.runtime.tuner import Config, _first_cached


def record(device: str, config: Config, ort_version: str = ort.__version__) -> dict:
    return {"choice": config.to_dict(), "device": device, "ort_version": ort_version, "timings_ms": {}}


def test_the_record_of_this_device_is_found_among_others() -> None:
    nhwc, nchw = Config("plain", True, "fp32", False), Config("plain", False, "fp32", False)
    configs = [nhwc, nchw]
    theirs, old_ort, mine = record("GPU Y", nhwc), record("GPU X", nhwc, "0.0"), record("GPU X", nchw)
    assert _first_cached([None, theirs, old_ort, mine], "GPU X", configs) == (mine, nchw)
    assert _first_cached([mine, theirs], "GPU Y", configs) == (theirs, nhwc)
    assert _first_cached([theirs, old_ort], "GPU X", configs) == (None, None)
    assert _first_cached([record("GPU X", Config("plain", True, "fp16"))], "GPU X", configs) == (None, None)
