"""The original's runs shared by the verifications of two candidates (``verify_shared``): inside
``shared_reference_runs`` the original is loaded once and run once per input set; outside, every verification
runs it itself; a wrong candidate is refused either way."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from service.errors import VerificationError
from service.optimizer.verify import verify_equivalent
from service.optimizer.verify_shared import shared_reference_runs


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many sessions were made and runs made, by the number of nodes of the model that ran."""
    counts: dict[str, int] = {}
    make, run = ort.InferenceSession.__init__, ort.InferenceSession.run

    def init(self, data, *args, **kwargs):
        make(self, data, *args, **kwargs)
        counts["sessions"] = counts.get("sessions", 0) + 1

    def counted_run(self, names, feeds, *args, **kwargs):
        counts["runs"] = counts.get("runs", 0) + 1
        return run(self, names, feeds, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", init)
    monkeypatch.setattr(ort.InferenceSession, "run", counted_run)
    return counts


def models(kit):
    """An original (Mul by 2 then Add 1) and two equal candidates written differently, and a wrong one."""
    x = kit.inp("x", ["N", 4])
    y = kit.out("y", ["N", 4])
    two, one = kit.init("two", np.float32(2)), kit.init("one", np.float32(1))
    original = kit.model([kit.node("Mul", ["x", "two"], ["m"]), kit.node("Add", ["m", "one"], ["y"])], [x], [y],
                         [two, one])
    a = kit.model([kit.node("Add", ["x", "x"], ["m"]), kit.node("Add", ["m", "one"], ["y"])], [x], [y], [one])
    b = kit.model([kit.node("Mul", ["x", "two"], ["m"]), kit.node("Add", ["one", "m"], ["y"])], [x], [y],
                  [two, one])
    wrong = kit.model([kit.node("Mul", ["x", "two"], ["y"])], [x], [y], [two])
    return original, a, b, wrong


def test_inside_the_original_runs_once_per_input_set(kit, counted: dict[str, int]) -> None:
    original, a, b, _ = models(kit)
    first = verify_equivalent(original, a)
    alone = dict(counted)
    counted.clear()
    with shared_reference_runs():
        verify_equivalent(original, a)
        shared_first = dict(counted)
        second = verify_equivalent(original, b)
    sets = len(first.batch_sizes) * 2  # the default two trials per batch size
    assert alone == {"sessions": 2, "runs": 2 * sets}  # outside: the original and the candidate, each set
    assert shared_first == alone
    assert counted == {"sessions": 3, "runs": 3 * sets}  # the second candidate ran alone
    assert second.batch_sizes == first.batch_sizes


def test_a_wrong_candidate_is_refused_with_shared_runs(kit) -> None:
    original, a, _, wrong = models(kit)
    with shared_reference_runs():
        verify_equivalent(original, a)
        with pytest.raises(VerificationError):
            verify_equivalent(original, wrong)


def test_another_original_never_takes_the_first_ones_runs(kit) -> None:
    original, a, _, wrong = models(kit)
    with shared_reference_runs():
        verify_equivalent(original, a)
        verify_equivalent(wrong, wrong)  # the other "original" must run itself: it equals itself
        with pytest.raises(VerificationError):
            verify_equivalent(wrong, a)
