"""bench/cpu_engines.py: the rounds alternate the engines and count every call; rows and ratios; the ORT
engines it builds compute what ORT computes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from engine_models import conv_relu_net

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cpu_engines  # noqa: E402


def test_rounds_alternate_and_count_every_call() -> None:
    calls: list[str] = []

    def runner(name: str):
        return lambda x: calls.append(name) or x

    cases = {("m", 1): {"a": runner("a"), "b": runner("b")}}
    samples = cpu_engines.time_rounds(cases, {("m", 1): np.zeros(1)}, rounds=2, per_round=lambda b: 3)
    assert calls == ["a"] * 5 + ["b"] * 5 + ["b"] * 5 + ["a"] * 5  # 2 untimed + 3 timed, reversed next round
    assert {k: len(v) for k, v in samples.items()} == {("m", 1, "a"): 6, ("m", 1, "b"): 6}


def test_rows_carry_medians_rel_and_ratios_in_table_order() -> None:
    samples = {("resnet50", 1, "ov_f32"): [2.0, 2.0, 2.0], ("resnet50", 1, "served"): [1.0, 1.0, 4.0],
               ("resnet50", 1, "ort_original"): [4.0, 4.0, 4.0], ("mobilenet_v3_large", 8, "served"): [3.0]}
    rows = cpu_engines.summarise(samples, {("resnet50", 1, "served"): 1e-6})
    assert [(r["model"], r["engine"]) for r in rows] == [
        ("mobilenet_v3_large", "served"), ("resnet50", "ort_original"), ("resnet50", "ov_f32"), ("resnet50", "served")]
    served = rows[-1]
    assert served["median_ms"] == 1.0 and served["rel"] == 1e-6
    assert served["vs_ov_f32"] == pytest.approx(0.5) and served["vs_ort_original"] == pytest.approx(0.25)
    assert rows[0]["vs_ov_f32"] is None  # no OpenVINO row for that model and batch


def test_rel_l2() -> None:
    ref = np.array([3.0, 4.0], np.float32)
    assert cpu_engines.rel_l2(ref, ref) == 0.0
    assert cpu_engines.rel_l2(ref * 1.1, ref) == pytest.approx(0.1, rel=1e-6)


def test_the_ort_runner_is_ort_on_the_graph() -> None:
    import onnxruntime as ort

    model = conv_relu_net().SerializeToString()
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(cpu_engines.ort_runner(model, 1)(x), expected, rtol=1e-5, atol=1e-6)
