"""random_feeds: the value kinds verification feeds, in the ranges their documentation promises."""

from __future__ import annotations

import numpy as np
import pytest

from service.optimizer.verify_inputs import INPUT_KINDS, InputSpec, kind_of_trial, random_feeds

IMAGE = InputSpec("x", np.float32, ("N", 3, "H", "W"))
VECTOR = InputSpec("v", np.float32, ("N", 8))
INDEX = InputSpec("i", np.int64, ("N", 5))


def _feeds(kind: str, seed: int = 0, batch: int = 2):
    return random_feeds([IMAGE, VECTOR, INDEX], batch, np.random.default_rng(seed), kind)


def test_trials_cycle_through_the_kinds_starting_with_noise():
    assert [kind_of_trial(t) for t in range(5)] == [*INPUT_KINDS, "normal"]


def test_normal_is_standard_normal_noise_as_before():
    rng = np.random.default_rng(0)
    feeds = random_feeds([VECTOR], 2, np.random.default_rng(0), "normal")
    np.testing.assert_array_equal(feeds["v"], rng.standard_normal((2, 8)).astype(np.float32))


def test_uniform_lies_in_the_unit_interval():
    feeds = _feeds("uniform")
    for name in ("x", "v"):
        assert feeds[name].min() >= 0.0 and feeds[name].max() < 1.0


def test_shapes_are_images_with_flat_rectangles_in_the_unit_range():
    feeds = _feeds("shapes")
    images = feeds["x"]
    assert images.shape == (2, 3, 224, 224) and images.dtype == np.float32
    assert images.min() >= 0.0 and images.max() <= 1.0
    # Rectangles are brighter (>= 0.38) than the gradient background (<= 0.32) and flat up to the texture:
    # neighbouring pixels differ by at most 0.04 except at the rectangles' edges.
    plane = images[0, 0]
    bright = plane >= 0.38
    assert 0.02 < bright.mean() < 0.9 and not ((plane > 0.32) & (plane < 0.38)).any()
    steps = np.abs(np.diff(plane, axis=1))
    assert 0.0 < (steps > 0.045).mean() < 0.05
    assert len(np.unique(plane)) > plane.size // 2  # the texture: no two windows are identical
    assert not np.array_equal(images[0], images[1])  # every image is drawn anew
    assert feeds["v"].min() >= 0.0 and feeds["v"].max() < 1.0  # not an image: uniform


def test_shapes255_is_the_pattern_in_pixel_range():
    images = _feeds("shapes255")["x"]
    assert images.max() > 100.0 and images.max() <= 255.0 and images.min() >= 0.0


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_integer_inputs_stay_small_indices_in_every_kind(kind):
    indices = _feeds(kind)["i"]
    assert indices.dtype == np.int64 and indices.min() >= 0 and indices.max() < 4


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown input kind 'pixels'"):
        _feeds("pixels")
