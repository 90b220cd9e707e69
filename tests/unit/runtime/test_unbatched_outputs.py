"""Outputs whose first dim is not the batch are served whole: the signature says which outputs carry the
batch, the optimizer declares it from shape inference, and the engine cuts (pads, chunks) only those.

Models: ``reshape_rows`` (one node, Reshape [1, 6] -> [3, 2]: the smallest reproduction of rows cut to the
request's) and ``detector_like`` (a batched ``logits`` beside ``boxes``/``scores`` whose rows depend on the
data, like an exported detector's), with a dynamic and a fixed batch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import detector_like, reference, reshape_rows, tiny_cnn

from service.errors import EngineError
from service.optimizer import OptimizerConfig, optimize
from service.optimizer.shapes import batched_outputs, declare_batch_dims
from service.runtime.contract import EngineOptions, Signature
from service.runtime.engine import OrtEngine

CPU = EngineOptions(device="cpu", buckets=(1, 2, 4))


def parsed(data: bytes) -> onnx.ModelProto:
    return onnx.load_from_string(data)


def batched(model: onnx.ModelProto) -> dict[str, bool]:
    return {spec.name: spec.batched for spec in Signature.from_onnx(model).outputs}


def cells(n: int, seed: int) -> np.ndarray:
    """Inputs of ``detector_like``: some 4-value cells above its threshold, a different number per seed."""
    return np.random.default_rng(seed).uniform(-1, 1.2, (n, 3, 8, 8)).astype(np.float32)


def test_the_signature_reads_which_outputs_carry_the_batch() -> None:
    assert batched(parsed(reshape_rows())) == {"y": False}
    assert batched(parsed(detector_like())) == {"logits": True, "boxes": False, "scores": False}
    assert batched(parsed(detector_like(batch=1))) == {"logits": True, "boxes": False, "scores": False}
    assert batched(parsed(tiny_cnn())) == {"logits": True, "features": True}
    for data, batchable in ((reshape_rows(), False), (detector_like(), False), (tiny_cnn(), True)):
        signature = Signature.from_onnx(parsed(data))
        assert signature.batchable is batchable
        assert signature.samples_per_call(8, 64) == (8 if batchable else 1)


def test_inference_finds_the_batch_whatever_the_exporter_named_it() -> None:
    model = parsed(tiny_cnn())
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "logits_dim_0"  # an exporter's own name
    assert batched(model)["logits"] is False
    assert batched_outputs(model) == {"logits": True, "features": True}
    declare_batch_dims(model, batched_outputs(model))
    assert batched(model) == {"logits": True, "features": True}


def test_inference_takes_the_batch_symbol_off_an_output_that_does_not_carry_it() -> None:
    model = parsed(reshape_rows())
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"  # declared wrongly
    assert batched(model) == {"y": True}
    assert batched_outputs(model) == {"y": False}
    declare_batch_dims(model, batched_outputs(model))
    assert batched(model) == {"y": False}


def test_outputs_inference_cannot_tell_about_keep_their_declaration() -> None:
    verdicts = batched_outputs(parsed(detector_like()))
    assert verdicts["logits"] is True and verdicts["boxes"] is not True and verdicts["scores"] is not True


def test_optimize_declares_the_batch_dims_of_what_it_writes() -> None:
    model = parsed(tiny_cnn())
    for info in model.graph.output:
        info.type.tensor_type.shape.dim[0].dim_param = f"{info.name}_n"
    optimized, _ = optimize(model, OptimizerConfig())
    assert batched(optimized) == {"logits": True, "features": True}
    optimized, _ = optimize(parsed(detector_like()), OptimizerConfig())
    assert batched(optimized) == {"logits": True, "boxes": False, "scores": False}


@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "bound"])
def test_a_reshape_of_the_rows_is_served_whole(io_binding: bool) -> None:
    data = reshape_rows()
    x = np.arange(6, dtype=np.float32).reshape(1, 6)
    with OrtEngine.load(data, CPU, _io_binding_on_cpu=io_binding) as engine:
        assert engine.describe()["io_binding"] is io_binding  # a fixed batch and declared shapes: bindable
        got = engine.run({"x": x})["y"]
    np.testing.assert_array_equal(got, reference(data, {"x": x})["y"])
    assert got.shape == (3, 2)


@pytest.mark.parametrize("batch", ["N", 1], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "bound"])
def test_a_detector_gets_every_detection_of_its_request(batch: int | str, io_binding: bool) -> None:
    data = detector_like(batch=batch)
    with OrtEngine.load(data, CPU, _io_binding_on_cpu=io_binding) as engine:
        assert engine.describe()["io_binding"] is False  # data-dependent rows: nothing to preallocate
        for n, seed in ((1, 1), (3, 2), (1, 3), (5, 4)):
            if batch == 1 and n > 1:
                continue
            x = cells(n, seed)
            want = reference(data, {"x": x})
            assert len(want["boxes"]) > n  # the rows a cut to the request's rows would lose
            got = engine.run({"x": x})
            for name in ("logits", "boxes", "scores"):
                np.testing.assert_array_equal(got[name], want[name])


def test_a_detector_with_a_dynamic_batch_is_neither_padded_nor_chunked() -> None:
    data = detector_like()
    x = cells(7, 9)  # above the largest bucket (4): chunks would give two sets of boxes
    with OrtEngine.load(data, CPU) as engine:
        got = engine.run({"x": x})
    np.testing.assert_array_equal(got["boxes"], reference(data, {"x": x})["boxes"])


def test_a_fixed_batch_model_with_unbatched_outputs_runs_only_its_batch() -> None:
    with OrtEngine.load(reshape_rows(), CPU) as engine, pytest.raises(EngineError, match="exactly its batch of 1"):
        engine.run_parts([{"x": np.zeros((1, 6), np.float32)}, {"x": np.zeros((1, 6), np.float32)}])
