"""bench/image_decode.py: every candidate computes the crop it claims to, and the timing loop alternates."""

from __future__ import annotations

import sys
from pathlib import Path

import images
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import image_decode  # noqa: E402


def test_antialiased_candidates_agree_with_the_reference():
    for data, is_jpeg in ((images.jpeg(500, 400), True), (images.png(400, 500), False)):
        reference = images.reference(data)
        for name, candidate in image_decode.candidates(data, is_jpeg).items():
            got = np.asarray(candidate(data))
            assert got.shape == (224, 224, 3), name
            diff = np.abs(got.astype(np.int16) - reference.astype(np.int16))
            # opencv-linear does not antialias and opencv-area is another filter: close, not equal
            assert diff.mean() < (3.0 if name.startswith("opencv") else 0.01), name


def test_timing_alternates_and_counts_every_call():
    calls: list[str] = []
    functions = {"a": lambda _d: calls.append("a"), "b": lambda _d: calls.append("b")}
    samples = image_decode.time_alternating(functions, b"", rounds=2, runs=2)
    assert calls == ["a", "b", "a", "a", "b", "b", "b", "b", "a", "a"]  # warm-up, then b first in round 1
    assert {name: len(times) for name, times in samples.items()} == {"a": 4, "b": 4}
    assert all(t >= 0 for times in samples.values() for t in times)
