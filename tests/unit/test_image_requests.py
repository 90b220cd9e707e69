"""service.image_requests: decoding off the event loop with bounded concurrency, KServe BYTES elements, and
the classification strings of a model's outputs."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import images
import numpy as np
import pytest

import service.image_requests as image_requests
from service.errors import InvalidInputError, PayloadTooLargeError, UnsupportedMediaTypeError
from service.image_requests import ImageDecoder, bytes_elements, classification, serialize_bytes
from service.imaging import Postprocess, Preprocess, decode_image
from service.runtime.contract import Signature, TensorSpec

SMALL = Preprocess(resize=16, crop=(8, 8))


def test_decoding_runs_on_the_pool_with_bounded_concurrency(monkeypatch) -> None:
    """Every image decodes on an ``image-decode`` thread, never the loop's, at most ``in_decode`` at once,
    while the loop keeps running other tasks."""
    lock, state = threading.Lock(), {"now": 0, "peak": 0, "threads": set()}

    def slow_decode(data, preprocess, *, index=0, max_pixels=0):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            state["threads"].add(threading.current_thread().name)
        time.sleep(0.03)
        with lock:
            state["now"] -= 1
        return decode_image(data, preprocess, index=index)

    monkeypatch.setattr(image_requests, "decode_image", slow_decode)
    decoder = ImageDecoder(threads=4, in_decode=2)
    data = [images.jpeg(32, 24, seed=s) for s in range(6)]

    async def main() -> tuple[np.ndarray, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        batch = await decoder.decode(data, SMALL)
        task.cancel()
        return batch, ticks

    batch, ticks = asyncio.run(main())
    decoder.close()
    assert batch.shape == (6, 3, 8, 8) and batch.dtype == np.uint8
    assert state["peak"] == 2, state  # the semaphore, not the 4 threads, bounds it
    assert state["threads"] and all(name.startswith("image-decode") for name in state["threads"])
    assert ticks >= 10  # about 90 ms of decoding: the loop ticked throughout


def test_a_decode_error_names_the_image_and_the_pool_survives() -> None:
    decoder = ImageDecoder(threads=2)
    good = images.png(20, 20)

    async def main() -> np.ndarray:
        with pytest.raises(InvalidInputError, match="image 1: truncated PNG"):
            await decoder.decode([good, good[:-30], good], SMALL)
        return await decoder.decode([good], SMALL)

    assert asyncio.run(main()).shape == (1, 3, 8, 8)
    decoder.close()


def test_bytes_elements_round_trip_and_refusals() -> None:
    elements = [b"", b"a", bytes(range(256)) * 3]
    blob = serialize_bytes(elements)
    assert bytes_elements(blob, 3, "x") == elements
    assert bytes_elements(memoryview(blob), 3, "x") == elements
    for buffer, count, message in [
        (blob, 4, "holds 3 elements, its shape 4"),
        (blob, 2, "more than the 2 elements"),
        (blob[:-1], 3, "claims 768 bytes, 767 remain"),
        (blob + b"\x01", 3, "more than the 3"),
        (b"\x01\x00", 1, "cut in its length prefix"),
    ]:
        with pytest.raises(InvalidInputError, match=message):
            bytes_elements(buffer, count, "x")


def _version(postprocess: Postprocess | None, preprocess: Preprocess | None = None, max_batch: int | None = None):
    signature = Signature((TensorSpec("input", np.dtype(np.uint8), (None, 3, 8, 8)),),
                          (TensorSpec("logits", np.dtype(np.float32), (None, 4)),
                           TensorSpec("features", np.dtype(np.float32), (None, 4))), max_batch=max_batch)
    config = types.SimpleNamespace(preprocess=preprocess, postprocess=postprocess)
    return types.SimpleNamespace(name="m", signature=signature, config=config)


def test_classification_strings_follow_the_postprocess_of_the_first_output_only() -> None:
    scores = np.array([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]], np.float32)
    mv = _version(Postprocess(labels=("a", "b", "c", "d")))
    got = classification(mv, "logits", scores, 2)
    assert got.shape == (2, 2) and got.dtype == object
    e = np.exp(scores[0] - 3.0)
    assert got[0].tolist() == [f"{e[1] / e.sum():f}:1:b".encode(), f"{e[2] / e.sum():f}:2:c".encode()]
    assert classification(mv, "features", scores, 1).tolist() == [[b"3.000000:1"], [b"5.000000:2"]]
    assert classification(_version(None), "logits", scores, 9).shape == (2, 4)  # k beyond C: all classes


def test_image_limits_and_models_without_images() -> None:
    with pytest.raises(UnsupportedMediaTypeError, match="uploaded without a preprocess config"):
        image_requests.image_input(_version(None))
    small = _version(None, Preprocess(), max_batch=3)
    image_requests.check_image_count(small, 3)
    with pytest.raises(PayloadTooLargeError, match="4 images in one request; model 'm' takes at most 3"):
        image_requests.check_image_count(small, 4)
    with pytest.raises(InvalidInputError, match="no image"):
        image_requests.check_image_count(small, 0)
    assert image_requests.max_images(_version(None, Preprocess())) == image_requests.MAX_IMAGES
