"""Signature.with_output_dims: inferred dims fill an output's dynamic dims and nothing else."""

from __future__ import annotations

import numpy as np

from service.runtime.contract import Signature, TensorSpec

F32 = np.dtype(np.float32)
SIGNATURE = Signature(
    (TensorSpec("x", F32, (None, 3, 16, 16)),),
    (TensorSpec("seg", F32, (None, None, None, None)), TensorSpec("logits", F32, (1, 1000))),
)


def test_dynamic_dims_are_filled_and_unknown_ones_stay_dynamic() -> None:
    filled = SIGNATURE.with_output_dims({"seg": [None, 21, 32, 32]})
    assert filled.outputs[0].shape == (None, 21, 32, 32)
    assert filled.outputs[1] == SIGNATURE.outputs[1] and filled.inputs == SIGNATURE.inputs
    assert filled.to_dict()["outputs"][0]["shape"] == [-1, 21, 32, 32]


def test_declared_dims_win_and_odd_entries_change_nothing() -> None:
    assert SIGNATURE.with_output_dims({"logits": [None, 10]}).outputs[1].shape == (1, 1000)
    for odd in ({"seg": [None, 21]}, {"seg": None}, {"nope": [1, 2, 3, 4]}, {"seg": [0, -1, 0, -5]}):
        assert SIGNATURE.with_output_dims(odd) == SIGNATURE, odd
