"""The naive baseline server: what most teams write first, to measure the real service against.

One ONNX Runtime session on the model as given (no graph optimizer of ours, ORT's defaults), one
request = one inference (no batching), plain FastAPI with the standard library's json, a sync
endpoint so FastAPI runs it in its thread pool, no IO binding, no CUDA graphs. Same request and
response format as the service's ``POST /predict``.

    python bench/naive_server.py MODEL.onnx [--port 8001] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import Body, FastAPI, HTTPException


def create_app(model_path: str, device: str = "cpu", name: str = "model") -> FastAPI:
    if device == "cuda":
        if hasattr(ort, "preload_dlls"):  # CUDA/cuDNN from pip wheels, where that is how they are installed
            ort.preload_dlls()
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(model_path, providers=providers)
    if session.get_providers()[0] != providers[0]:
        # a silent fall-back to the CPU would make the baseline meaninglessly slow
        raise SystemExit(f"naive server: {providers[0]} is not usable here (got {session.get_providers()})")
    input_types = {i.name: np.float16 if i.type == "tensor(float16)" else np.float32 for i in session.get_inputs()}
    output_names = [o.name for o in session.get_outputs()]
    app = FastAPI(title="naive baseline")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ready": True, "providers": session.get_providers()}

    @app.post("/predict")
    def predict(payload: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008 (FastAPI idiom)
        try:
            feeds = {k: np.asarray(payload["inputs"][k], dtype=t) for k, t in input_types.items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPException(status_code=400, detail=f"bad inputs: {exc}") from exc
        outputs = session.run(output_names, feeds)
        return {
            "model": name,
            "version": 1,
            "outputs": {n: o.tolist() for n, o in zip(output_names, outputs, strict=True)},
        }

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="ONNX model file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--name", default="model", help="model name echoed in responses")
    args = parser.parse_args()
    uvicorn.run(create_app(args.model, args.device, args.name), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
