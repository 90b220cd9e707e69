"""service.optimizer.shapes: output dims as ONNX shape inference gives them, with the batch dim symbolic."""

from __future__ import annotations

import numpy as np

from service.optimizer.shapes import INLINE_CONSTANT_ELEMENTS, inferred_shapes, output_dims


def _segmenter_head(kit, batch, size=("64", "64"), classes: int = 21):
    """FCN-style: a strided conv to ``classes`` channels, then Resize back to the input's H, W, with the sizes
    computed from Shape(x) (as torchvision's F.interpolate(size=x.shape[-2:]) exports). The output is declared
    with exporter-style symbols only."""
    nodes = [
        kit.node("Conv", ["x", "w"], ["logits"], strides=[2, 2], pads=[1, 1, 1, 1]),
        kit.node("Shape", ["x"], ["x_shape"]),
        kit.node("Slice", ["x_shape", "two", "four"], ["hw"]),
        kit.node("Shape", ["logits"], ["l_shape"]),
        kit.node("Slice", ["l_shape", "zero", "two"], ["nc"]),
        kit.node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        kit.node("Resize", ["logits", "", "", "sizes"], ["out"], mode="linear"),
    ]
    inits = [
        kit.init("w", kit.weights(classes, 3, 3, 3)),
        *(kit.init(name, np.array([v], np.int64)) for name, v in (("zero", 0), ("two", 2), ("four", 4))),
    ]
    spatial = [int(s) if s.isdigit() else s for s in size]
    return kit.model(nodes, [kit.inp("x", [batch, 3, *spatial])], [kit.out("out", ["d0", "d1", "d2", "d3"])], inits)


def test_segmenter_head_with_symbolic_batch_gives_concrete_classes_and_spatial_dims(kit):
    model = _segmenter_head(kit, "N")
    before = model.SerializeToString()
    assert output_dims(model) == {"out": [None, 21, 64, 64]}
    assert model.SerializeToString() == before  # the model itself is never touched


def test_a_fixed_batch_of_one_is_made_symbolic(kit):
    # The exporter's example batch 1 must not be reported as the model's batch.
    assert output_dims(_segmenter_head(kit, 1, classes=5)) == {"out": [None, 5, 64, 64]}


def test_symbolic_spatial_dims_stay_unknown(kit):
    assert output_dims(_segmenter_head(kit, "N", size=("H", "W"))) == {"out": [None, 21, None, None]}


def test_data_dependent_dims_are_unknown(kit):
    nodes = [kit.node("NonZero", ["x"], ["nz"]), kit.node("Transpose", ["nz"], ["y"], perm=[1, 0])]
    model = kit.model(nodes, [kit.inp("x", ["N", 4, 4])], [kit.out("y", ["K", 3], 7)])
    assert output_dims(model) == {"y": [None, 3]}


def test_shapes_resolve_when_large_weights_travel_as_typed_inputs(kit):
    big = INLINE_CONSTANT_ELEMENTS + 1
    nodes = [kit.node("Gemm", ["x", "w"], ["y"], transB=1)]
    model = kit.model(nodes, [kit.inp("x", ["N", big])], [kit.out("y", ["N", "M"])],
                      [kit.init("w", np.zeros((3, big), np.float32))])  # fmt: skip
    assert output_dims(model) == {"y": [None, 3]}
    shapes = inferred_shapes(model)
    assert shapes["w"] == (3, big) and shapes["y"] == ("N", 3)


def test_dims_that_two_inference_runs_invent_never_share_a_name():
    """Shape inference names each dim it cannot resolve ``unk__N`` afresh per run; tensors filled by two
    runs must not claim equal sizes through such a name (ONNX Runtime plans buffer reuse by it: Faster
    R-CNN's optimized graph failed with "Shape mismatch attempting to re-use buffer {0} != {91}")."""
    import onnx_graphsurgeon as gs

    from service.optimizer.passes._shapes import ensure_types

    def nonzero_graph() -> tuple[gs.Graph, gs.Variable]:
        x, out = gs.Variable("x", np.float32, ["N", 8]), gs.Variable("nz", None, None)
        return gs.Graph(nodes=[gs.Node("NonZero", inputs=[x], outputs=[out])], inputs=[x], opset=13), out

    (first, a), (second, b) = nonzero_graph(), nonzero_graph()
    ensure_types(first)
    ensure_types(second)
    assert a.shape[0] == b.shape[0] == 2
    assert isinstance(a.shape[1], str) and isinstance(b.shape[1], str) and a.shape[1] != b.shape[1]
