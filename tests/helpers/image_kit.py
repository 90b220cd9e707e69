"""The reference pipeline of the image tests, written out independently of the server's request path:
the same decoder and resize (``service.imaging.decode_image``), then numpy normalisation, ONNX Runtime's CPU
provider on the ORIGINAL float model (optimizations off), a float64 softmax and a stable top-k.

``classifier`` is the served test model: ``tiny_cnn`` with 10 classes, input [N, 3, 8, 8]; ``CONFIG`` makes
it an image model (shorter side to 12, centre crop 8x8, ImageNet mean/std, uint8 wire) with ``LABELS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import builders
import numpy as np

from service.imaging import Preprocess, decode_image

LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
PREPROCESS = {"resize": 12, "crop": [8, 8]}
CONFIG = {"preprocess": PREPROCESS, "postprocess": {"labels": list(LABELS)}}
MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


def classifier(seed: int = 0) -> bytes:
    return builders.tiny_cnn(seed=seed, classes=len(LABELS))


def pixels(images: Sequence[bytes], preprocess: dict | None = None) -> np.ndarray:
    """uint8 [N, 3, H, W] RGB: what a client sends as a uint8 tensor."""
    p = Preprocess.model_validate(preprocess or PREPROCESS)
    return np.stack([decode_image(data, p) for data in images]).transpose(0, 3, 1, 2).copy()


def normalised(wire: np.ndarray) -> np.ndarray:
    """float32 NCHW ``(p / 255 - mean) / std`` computed in float64."""
    x = (wire.astype(np.float64) / 255.0 - MEAN.reshape(1, 3, 1, 1)) / STD.reshape(1, 3, 1, 1)
    return x.astype(np.float32)


def logits(model: bytes, images: Sequence[bytes], preprocess: dict | None = None) -> np.ndarray:
    return builders.reference(model, {"input": normalised(pixels(images, preprocess))})["logits"]


def softmax(scores: np.ndarray) -> np.ndarray:
    x = scores.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def top_k(model: bytes, images: Sequence[bytes], k: int = 5, preprocess: dict | None = None) -> list[list[dict]]:
    """Per image, ``{"label", "index", "score"}`` of the k best classes, best first."""
    probs = softmax(logits(model, images, preprocess))
    return [
        [{"label": LABELS[i], "index": int(i), "score": float(row[i])} for i in np.argsort(-row, kind="stable")[:k]]
        for row in probs
    ]


def assert_same_top(got: list[list[dict]], want: list[list[dict]]) -> None:
    """Same classes in the same order; scores within float rounding of the folded graph."""
    assert [[(p["label"], p["index"]) for p in row] for row in got] == [
        [(p["label"], p["index"]) for p in row] for row in want
    ]
    np.testing.assert_allclose(
        [[p["score"] for p in row] for row in got], [[p["score"] for p in row] for row in want], rtol=1e-4, atol=1e-6
    )


def class_strings(top: list[list[dict]]) -> list[list[tuple[float, int, str]]]:
    """Reference top-k as the parsed parts of Triton classification strings."""
    return [[(p["score"], p["index"], p["label"]) for p in row] for row in top]


def parse_class_strings(rows: np.ndarray) -> list[list[tuple[float, int, str]]]:
    """tritonclient's ``as_numpy`` of a classification output -> (score, index, label) per entry."""
    parsed = []
    for row in rows:
        entries = []
        for item in row:
            text = item.decode() if isinstance(item, bytes) else str(item)
            score, index, label = text.split(":", 2)
            entries.append((float(score), int(index), label))
        parsed.append(entries)
    return parsed


def assert_same_strings(got: list[list[tuple[float, int, str]]], want: list[list[tuple[float, int, str]]]) -> None:
    assert [[(i, label) for _, i, label in row] for row in got] == [[(i, label) for _, i, label in row] for row in want]
    # printf("%f") keeps 6 decimals
    np.testing.assert_allclose([[s for s, _, _ in row] for row in got], [[s for s, _, _ in row] for row in want],
                               atol=1.5e-6)
