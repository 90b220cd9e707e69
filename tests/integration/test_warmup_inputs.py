"""The request a version serves itself before any client runs on inputs its original ran on
(``registry.warmup_inputs``): a model that fails on some values (as torchvision's Mask R-CNN's value-dependent
Reshape failed on zeros, answering its upload with a 500) is served, and its warm-up costs only the inputs it
fails on. Through the registry with real optimizer children, on the CPU provider."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_engine_threads import settings_for

from service.model_config import ModelConfig
from service.registry.manager import ModelManager
from service.registry.warmup_inputs import warmup_requests
from service.runtime.contract import Signature, TensorSpec

pytestmark = pytest.mark.timeout(240)


def fails_on_zeros() -> bytes:
    """y = x reshaped to [-1, k], k = 1 when any |x| > 0, else 0: on all-zero input ORT cannot reshape."""
    nodes = [
        helper.make_node("Abs", ["x"], ["a"]),
        helper.make_node("ReduceSum", ["a"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["k"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["k", "axis0"], ["k1"]),
        helper.make_node("Concat", ["minus_one", "k1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=1),  # a 0 in the shape is a 0, not a copy
    ]
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    graph = helper.make_graph(nodes, "fails_on_zeros",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def test_a_model_that_fails_on_zeros_is_served_after_a_warm_up_on_inputs_it_ran_on(tmp_path: Path) -> None:
    async def main() -> tuple[str, np.ndarray]:
        manager = ModelManager(settings_for(tmp_path))
        await manager.start()
        staged = manager.new_staging_file()
        staged.write_bytes(fails_on_zeros())
        mv = await manager.upload("value_dependent", staged, ModelConfig())
        x = np.arange(1, 9, dtype=np.float32).reshape(2, 4)
        result = await mv.infer(mv.signature.request({"x": x}))
        state = mv.state.value
        await manager.stop(1)
        return state, result.outputs["y"]

    state, y = asyncio.run(main())
    assert state == "READY"
    np.testing.assert_array_equal(y, np.arange(1, 9, dtype=np.float32).reshape(8, 1))


def test_the_warm_up_takes_the_verified_kinds_first_then_zeros() -> None:
    signature = Signature((TensorSpec("image", np.dtype(np.float32), (None, 3, 8, 8)),),
                          (TensorSpec("y", np.dtype(np.float32), (None, 10)),))
    requests = warmup_requests(signature, {"verify_input_kinds": ["uniform", "shapes255", "bogus"]})
    values = [r.inputs["image"] for r in requests]
    assert len(values) == 3 and all(v.shape == (1, 3, 8, 8) for v in values)
    assert values[0].min() >= 0.0 and values[0].max() < 1.0  # uniform [0, 1)
    assert values[1].max() > 1.0  # pixels in [0, 255]
    assert not values[2].any()  # zeros last
    assert [r.inputs["image"].any() for r in warmup_requests(signature, None)] == [False]
    free = Signature((TensorSpec("image", np.dtype(np.float32), (None, 3, None, None)),), signature.outputs)
    assert warmup_requests(free, {"verify_input_kinds": ["normal"]}) == []  # no safe shape: no warm-up


def test_a_model_that_fails_on_every_warm_up_input_is_refused_naming_the_error() -> None:
    """An engine that fails wherever it runs (the original ran on these inputs) is a 422 naming the error, not a
    500 (the upload's rollback then removes the version)."""
    from engine_models import ThreadBoundEngine

    from service.errors import EngineError, UnprocessableError
    from service.registry.version import ModelVersion

    class Failing(ThreadBoundEngine):
        def run_parts(self, parts):  # type: ignore[no-untyped-def]
            raise EngineError("inference failed on CPUExecutionProvider: Reshape node cannot reshape")

    async def main() -> None:
        mv = ModelVersion("m", 1, None, ModelConfig().effective(settings_for(Path("."))), max_input_bytes=1 << 20)
        with pytest.raises(UnprocessableError, match=r"failed on every input it was warmed with .*zeros.*Reshape"):
            await mv.activate(Failing())
        await mv.shutdown(timeout_s=1)

    asyncio.run(main())
