"""Decode + resize + centre crop of one image, per decoder candidate, on one CPU core.

    python bench/image_decode.py [--rounds 15] [--runs 10] [--cpu N] [--quick]

Each candidate turns JPEG/PNG bytes into the same uint8 224x224x3 RGB crop (shorter side to 256, centre
crop 224, torchvision's rules via ``service.imaging.geometry``):

- ``service``: ``service.imaging.decode_image`` itself (header checks, Pillow, JPEG draft, box resize);
- ``pillow-full``: Pillow, no draft, box resize; ``torchvision-style``: Pillow, no draft, the whole image
  resized and then cropped, as ``transforms.Resize(256) + CenterCrop(224)`` on a PIL image (the reference
  every candidate is compared with: ``max_diff``/``mean_diff`` in grey levels);
- ``simplejpeg+pillow``: simplejpeg (libjpeg-turbo, DCT scaling by powers of two as the draft) decodes,
  Pillow resamples the box;
- ``pyturbojpeg+pillow``: the same through PyTurboJPEG (only where a libturbojpeg is installed);
- ``opencv-area`` / ``opencv-linear``: ``cv2.imdecode`` (``IMREAD_REDUCED_COLOR_k`` as the draft) and
  ``cv2.resize`` with INTER_AREA (antialiased) or INTER_LINEAR (not antialiased: it aliases) then a crop.

Rows ``decode:*`` and ``resize:*`` time the two halves alone. The process is pinned to one core
(``os.sched_setaffinity``; OpenCV to one thread); candidates alternate within every round, so they share the
same minutes of a noisy machine; medians over ``rounds * runs`` calls. Images are made in code
(``tests/helpers/images.py``: gradients, texture, edges, noise; JPEG quality 90). Prints a table and writes
``bench/results/image-decode-<date>-cpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

import images  # noqa: E402  (tests/helpers/images.py)

from bench import common  # noqa: E402
from service.imaging import Preprocess, decode_image  # noqa: E402
from service.imaging.geometry import Plan, plan  # noqa: E402

TARGET_MS = 2.0
GAP = 2.0
PREPROCESS = Preprocess()  # shorter side 256, centre crop 224
Candidate = Callable[[bytes], Any]


def _optional(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        return None


cv2 = _optional("cv2")
simplejpeg = _optional("simplejpeg")
turbojpeg_module = _optional("turbojpeg")


def _turbo() -> Any:
    if turbojpeg_module is None:
        return None
    try:
        return turbojpeg_module.TurboJPEG()
    except (OSError, RuntimeError):  # the Python wrapper without a libturbojpeg to load
        return None


TURBO = _turbo()


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What every candidate needs to know about the image, worked out once before timing (so the
    candidates pay only for decoding and resampling; ``service`` still pays for its own header checks)."""

    layout: Plan
    width: int
    height: int

    @classmethod
    def of(cls, data: bytes) -> Geometry:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
        return cls(plan(width, height, 1, PREPROCESS, 0), width, height)


def _box_resize(image: Image.Image, layout: Plan, scale: float) -> np.ndarray:
    box = tuple(min(v / scale, limit) for v, limit in zip(layout.box, (math.inf, math.inf, *image.size), strict=True))
    return np.asarray(image.resize(layout.size, Image.Resampling.BILINEAR, box=box))


def _resized_size(width: int, height: int) -> tuple[int, int]:
    """torchvision's Resize(256): the shorter side to 256, the longer one rounded down."""
    return (256, int(256 * height / width)) if width <= height else (int(256 * width / height), 256)


def _centre_crop(pixels: np.ndarray) -> np.ndarray:
    height, width = pixels.shape[:2]
    top, left = round((height - 224) / 2.0), round((width - 224) / 2.0)
    return pixels[top : top + 224, left : left + 224]


def torchvision_style(data: bytes, _geometry: Geometry) -> np.ndarray:
    """The reference: full decode, whole image resized, then cropped (what torchvision does on PIL)."""
    return images.reference(data)


def pillow_full(data: bytes, geometry: Geometry) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    image = image if image.mode == "RGB" else image.convert("RGB")
    return _box_resize(image, geometry.layout, 1.0)


def service_path(data: bytes, _geometry: Geometry) -> np.ndarray:
    return decode_image(data, PREPROCESS)


def _power_of_two_decode(data: bytes, geometry: Geometry, decode: Callable[..., np.ndarray]) -> np.ndarray:
    scale = geometry.layout.draft_scale(GAP)
    expected = (math.ceil(geometry.height / scale), math.ceil(geometry.width / scale))
    pixels = decode(data, scale, expected)
    if pixels.shape[:2] != expected:
        raise RuntimeError(f"decoder scaled to {pixels.shape[:2]}, expected {expected}")
    return _box_resize(Image.fromarray(pixels), geometry.layout, float(scale))


def _simplejpeg_decode(data: bytes, _scale: int, expected: tuple[int, int]) -> np.ndarray:
    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=expected[0], min_width=expected[1])


def _turbo_decode(data: bytes, scale: int, _expected: tuple[int, int]) -> np.ndarray:
    from turbojpeg import TJPF_RGB

    return TURBO.decode(data, pixel_format=TJPF_RGB, scaling_factor=(1, scale))


def simplejpeg_pillow(data: bytes, geometry: Geometry) -> np.ndarray:
    return _power_of_two_decode(data, geometry, _simplejpeg_decode)


def pyturbojpeg_pillow(data: bytes, geometry: Geometry) -> np.ndarray:
    return _power_of_two_decode(data, geometry, _turbo_decode)


def _opencv(data: bytes, geometry: Geometry, interpolation: int, is_jpeg: bool) -> np.ndarray:
    scale = geometry.layout.draft_scale(GAP) if is_jpeg else 1
    flags = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
             8: cv2.IMREAD_REDUCED_COLOR_8}[scale]  # fmt: skip
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    resized = cv2.resize(bgr, _resized_size(geometry.width, geometry.height), interpolation=interpolation)
    return np.ascontiguousarray(_centre_crop(resized)[..., ::-1])


def candidates(data: bytes, is_jpeg: bool) -> dict[str, Candidate]:
    """The end-to-end candidates that exist here for this format, bound to the image's geometry."""
    found: dict[str, Callable[[bytes, Geometry], Any]] = {"service": service_path, "pillow-full": pillow_full,
                                                          "torchvision-style": torchvision_style}  # fmt: skip
    if is_jpeg and simplejpeg is not None:
        found["simplejpeg+pillow"] = simplejpeg_pillow
    if is_jpeg and TURBO is not None:
        found["pyturbojpeg+pillow"] = pyturbojpeg_pillow
    if cv2 is not None:
        found["opencv-area"] = functools.partial(_opencv, interpolation=cv2.INTER_AREA, is_jpeg=is_jpeg)
        found["opencv-linear"] = functools.partial(_opencv, interpolation=cv2.INTER_LINEAR, is_jpeg=is_jpeg)
    geometry = Geometry.of(data)
    return {name: functools.partial(_bound, function, geometry) for name, function in found.items()}


def _bound(function: Callable[[bytes, Geometry], Any], geometry: Geometry, data: bytes) -> Any:
    return function(data, geometry)


def components(data: bytes, is_jpeg: bool) -> dict[str, Candidate]:
    """Decode alone (full size) and resize alone (from already decoded pixels)."""
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    decoded = Image.fromarray(pixels)
    layout = Geometry.of(data).layout
    size = _resized_size(*decoded.size)
    found: dict[str, Candidate] = {
        "decode:pillow": lambda d: Image.open(io.BytesIO(d)).load(),
        "resize:pillow-box": lambda _d: decoded.resize(layout.size, Image.Resampling.BILINEAR, box=layout.box),
        "resize:pillow-whole": lambda _d: decoded.resize(size, Image.Resampling.BILINEAR),
    }
    if is_jpeg and simplejpeg is not None:
        found["decode:simplejpeg"] = lambda d: simplejpeg.decode_jpeg(d, colorspace="RGB")
    if is_jpeg and TURBO is not None:
        found["decode:pyturbojpeg"] = lambda d: TURBO.decode(d)
    if cv2 is not None:
        found["decode:opencv"] = lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR)
        found["resize:opencv-area"] = lambda _d: cv2.resize(pixels, size, interpolation=cv2.INTER_AREA)
        found["resize:opencv-linear"] = lambda _d: cv2.resize(pixels, size, interpolation=cv2.INTER_LINEAR)
    return found


def time_alternating(functions: dict[str, Candidate], data: bytes, rounds: int, runs: int) -> dict[str, list[float]]:
    """Per-call milliseconds of every function; each round runs every function ``runs`` times in turn."""
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for function in functions.values():  # warm-up: imports, caches, first-call allocations
        function(data)
    for round_index in range(rounds):
        order = list(functions.items())
        if round_index % 2:
            order.reverse()
        for name, function in order:
            for _ in range(runs):
                started = time.perf_counter_ns()
                function(data)
                samples[name].append((time.perf_counter_ns() - started) / 1e6)
    return samples


def fidelity(function: Candidate, data: bytes, reference: np.ndarray) -> tuple[int, float]:
    diff = np.abs(np.asarray(function(data)).astype(np.int16) - reference.astype(np.int16))
    return int(diff.max()), float(diff.mean())


def pin_one_core(cpu: int | None) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    chosen = allowed[-1] if cpu is None else cpu
    os.sched_setaffinity(0, {chosen})
    if cv2 is not None:
        cv2.setNumThreads(1)
    return chosen


def test_images(quick: bool) -> list[tuple[str, bytes, str]]:
    made = [("jpeg-640x480", images.jpeg(640, 480), "JPEG"), ("png-640x480", images.png(640, 480), "PNG")]
    if not quick:
        made.insert(1, ("jpeg-1920x1080", images.jpeg(1920, 1080), "JPEG"))
    return made


def run(rounds: int, runs: int, quick: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, described = [], []
    for label, data, fmt in test_images(quick):
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
        described.append({"image": label, "bytes": len(data), "bits_per_pixel": 8 * len(data) / (width * height)})
        is_jpeg = fmt == "JPEG"
        reference = images.reference(data)
        ends = candidates(data, is_jpeg)
        functions = {**ends, **components(data, is_jpeg)}
        samples = time_alternating(functions, data, rounds, runs)
        for name, times in samples.items():
            row: dict[str, Any] = {"image": label, "candidate": name, "median_ms": common.median(times),
                                   "p10_ms": common.percentile(times, 10), "p90_ms": common.percentile(times, 90),
                                   "min_ms": min(times), "calls": len(times)}  # fmt: skip
            if name in ends:
                row["max_diff"], row["mean_diff"] = fidelity(ends[name], data, reference)
            rows.append(row)
    return rows, described


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cpu", type=int, help="core to pin to (default: the last one this process may use)")
    parser.add_argument("--quick", action="store_true", help="640x480 JPEG and PNG only, 4 rounds of 5")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rounds, runs = (4, 5) if args.quick else (args.rounds, args.runs)
    head = common.header(packages=("numpy", "PIL", "simplejpeg", "cv2", "turbojpeg"))
    core = pin_one_core(args.cpu)
    load_before = os.getloadavg()
    rows, described = run(rounds, runs, args.quick)
    load_after = os.getloadavg()
    common.print_table(described, ["image", "bytes", "bits_per_pixel"], title="test images")
    common.print_table(
        rows,
        ["image", "candidate", "median_ms", "p10_ms", "p90_ms", "min_ms", "max_diff", "mean_diff"],
        title=f"decode + resize 256 + centre crop 224, one core (cpu {core}), ms per image",
    )
    service = next(r for r in rows if r["image"] == "jpeg-640x480" and r["candidate"] == "service")
    verdict = "meets" if service["median_ms"] <= TARGET_MS else "misses"
    print(f"\nservice path, 640x480 JPEG: {service['median_ms']:.3f} ms median ({service['p10_ms']:.3f} p10): "
          f"{verdict} the {TARGET_MS} ms target; load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    document = {
        "benchmark": "image_decode",
        "task": "JPEG/PNG bytes -> resize shorter side 256 (bilinear, antialiased) -> centre crop 224 -> uint8 RGB",
        "settings": {"rounds": rounds, "runs": runs, "cpu": core, "draft_gap": GAP, "quick": args.quick},
        # Other processes on the machine: a loaded machine inflates medians and p90s, less so p10 and min.
        "load_average_1_5_15_min": {"before": load_before, "after": load_after},
        "target_ms": TARGET_MS,
        "service_640x480_jpeg_median_ms": service["median_ms"],
        "images": described,
        "rows": rows,
        "notes": "max_diff/mean_diff: grey levels against torchvision-style (full decode, whole resize, crop); "
        "decode:* and resize:* rows time one half alone (full-size decode; resize of decoded pixels).",
    }
    path = args.out or common.RESULTS_DIR / f"image-decode-{head['date']}-cpu.json"
    print("wrote", common.write_result("image-decode", document, head=head, path=path))


if __name__ == "__main__":
    main()
