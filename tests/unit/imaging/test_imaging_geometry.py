"""geometry.plan: torchvision's resize and centre-crop arithmetic, the orientation mapping, the draft scale."""

from __future__ import annotations

import pytest

from service.imaging import Preprocess
from service.imaging.geometry import plan


@pytest.mark.parametrize(
    ("size", "box"),
    [
        # 640x480 -> 341x256 (int(256 * 640 / 480) = 341), crop at left round(58.5) = 58 (half to even), top 16
        ((640, 480), (58 * 640 / 341, 16 * 480 / 256, 282 * 640 / 341, 240 * 480 / 256)),
        # 480x640 -> 256x341: the crop's top is 58
        ((480, 640), (16 * 480 / 256, 58 * 640 / 341, 240 * 480 / 256, 282 * 640 / 341)),
        # already 256 on the shorter side: a plain centre crop of 257x256 -> left round(16.5) = 16
        ((257, 256), (16.0, 16.0, 240.0, 240.0)),
    ],
)
def test_box_follows_torchvisions_rounding(size, box):
    layout = plan(*size, 1, Preprocess(), 0)
    assert layout.size == (224, 224)
    assert layout.box == pytest.approx(box)
    assert layout.transpose is None


def test_a_quarter_turn_swaps_the_box_into_the_stored_frame():
    # Stored 480 wide x 640 high, orientation 6 (shown rotated to 640x480): the upright crop box
    # (58, 16)-(282, 240) in 341x256 units maps to stored rows counted from the right edge.
    layout = plan(480, 640, 6, Preprocess(resize=256, crop=(200, 224)), 0)
    sx, sy = 640 / 341, 480 / 256
    x0, y0, x1, y1 = 58 * sx, 28 * sy, 282 * sx, 228 * sy  # upright box
    assert layout.size == (200, 224)  # (width, height) in the stored frame: the crop's height and width swap
    assert layout.box == pytest.approx((y0, 640 - x1, y1, 640 - x0))


def test_unknown_orientations_count_as_upright():
    assert plan(640, 480, 9, Preprocess(), 0) == plan(640, 480, 1, Preprocess(), 0)
    assert plan(640, 480, 0, Preprocess(), 0) == plan(640, 480, 1, Preprocess(), 0)


@pytest.mark.parametrize(
    ("size", "scale"), [((640, 480), 1), ((1024, 1024), 2), ((1920, 1080), 2), ((4032, 3024), 4), ((8000, 8000), 8)]
)
def test_draft_scale_keeps_two_source_pixels_per_output_pixel(size, scale):
    layout = plan(*size, 1, Preprocess(), 0)
    assert layout.draft_scale(2.0) == scale


def test_plain_crop_is_recognised_only_without_scaling():
    assert plan(300, 200, 1, Preprocess(resize=None, crop=(100, 100)), 0).is_plain_crop()
    assert not plan(300, 200, 1, Preprocess(resize=150, crop=(100, 100)), 0).is_plain_crop()
