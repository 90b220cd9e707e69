"""Validate + optimize (+ verify) one model in a resource-limited child process.

Why a child process: an uploaded model is hostile until proven otherwise. Constant folding and ONNX
Runtime (during verification) may be asked to materialize huge tensors (a 152-byte ConstantOfShape can
ask for gigabytes), protobuf parsing of a crafted file may take a lot of memory, and a pass may loop. In
a child with an address-space limit (``RLIMIT_AS``) and a wall-clock timeout, such a model costs one
failed upload (``OptimizationError``, 422), never the server. The child dies with its parent
(``PR_SET_PDEATHSIG``), so a killed server leaves no orphan writing into the store.

Protocol: ``python -m service.registry.sandbox INPUT OUT_DIR --variants fused,plain --verify 0|1
--memory-limit-mb N [--preprocess JSON] [--label-count N] [--rtol R] [--atol A]``; ``--rtol``/``--atol``
come only where the model sets its own tolerance (left out, verification takes the default of the graph's
precision). The child writes the optimized variants into OUT_DIR (``optimized.onnx``, and
``optimized-plain.onnx`` when both are asked for and FusedConv changed the graph) and ``result.json``
last. The parent reads only ``result.json``; a missing or unreadable one
means the child crashed. ``result.json``'s signature is the SERVED graph's (what clients send).

Image models: ``--preprocess`` (a ``Preprocess`` as JSON) and ``--label-count`` (the labels of its
``Postprocess``; only their number matters here) are checked against the uploaded model first
(``image_config``); with a uint8 wire the normalisation is folded into every variant
(``OptimizerConfig.input_normalization``) and verified against the original fed the normalised floats.

Variants: "fused" (com.microsoft.FusedConv allowed) is what ORT's CPU provider likes; "plain" (no
FusedConv) is what CUDA (NHWC; FusedConv has no NHWC form) and the OpenVINO EP run. Only the variants the
server's tuner can choose among are made (``--variants``; ``runtime.tuner.choosable_variants``); when a graph
has nothing FusedConv could fuse, one file serves as "plain".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from service.errors import (
    InsufficientStorageError,
    InvalidModelError,
    OptimizationError,
    ServiceError,
    UnprocessableError,
    VerificationError,
)
from service.model_config import VerifyTolerance
from service.registry.variants import FUSED_FILE, KERNELS_FILE, PLAIN_FILE, looks_like_oom, write_synced
from service.runtime.fused_ops import VARIANT

log = logging.getLogger(__name__)

RESULT = "result.json"
_OUTPUT_TAIL = 4000
EXIT_NO_SPACE = 4
"""The child's exit status when the disk is too full even for its report (the parent answers 507)."""
_SIGNATURE_RE = re.compile(r"onnxruntime::[\w:]+(?:\([^)]*\))?\s*")
_SOURCE_PATH_RE = re.compile(r"\S*/\S+\.(?:cc|cpp|c|h|hpp|cu|py|so)\b(?::\d+)?:?\s*")
# Errors the child may report, by class name; anything else becomes a plain OptimizationError.
_ERRORS: dict[str, type[ServiceError]] = {
    cls.__name__: cls
    for cls in (
        InvalidModelError,
        OptimizationError,
        VerificationError,
        UnprocessableError,
        InsufficientStorageError,
    )
}


@dataclasses.dataclass(frozen=True)
class ImageArgs:
    """What the child needs of an image model's config: the preprocessing (JSON of ``Preprocess``) and how
    many labels its postprocessing lists."""

    preprocess: str | None = None
    label_count: int | None = None

    def argv(self) -> list[str]:
        args = ["--preprocess", self.preprocess] if self.preprocess is not None else []
        return args + (["--label-count", str(self.label_count)] if self.label_count is not None else [])


@dataclasses.dataclass
class OptimizeOutcome:
    """What the parent gets back: the files in ``out_dir`` and what the child reported."""

    out_dir: Path
    sha256: str
    size: int
    signature: dict[str, Any]
    """``Signature.to_dict()`` of the served graph (the uploaded model's, unless a normalisation was folded)."""
    variants: dict[str, dict[str, Any]]
    """variant name ("fused" / "plain") -> {"file": artifact file name, "report": OptimizationReport dict}"""
    duration_s: float

    def files(self) -> dict[str, Path]:
        return {v["file"]: self.out_dir / v["file"] for v in self.variants.values()}


class _Job:
    """Links an async caller to its child: cancelling the caller kills the child, even one that the
    worker thread starts only after the cancellation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._cancelled = False

    def started(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._proc = proc
            cancelled = self._cancelled
        if cancelled:
            _kill(proc)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            proc = self._proc
        if proc is not None:
            _kill(proc)


class OptimizerRunner:
    """Starts optimizer children and remembers the live ones, so shutdown can kill them."""

    def __init__(self, *, timeout_s: float, memory_limit_mb: int, fused_ops_library: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.fused_ops_library = fused_ops_library
        """The library the fused-op variant is made with (it is made only where one is given and asked for)."""
        self._live: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()

    async def run(
        self, source: Path, out_dir: Path, *, variants: frozenset[str], verify: bool, image: ImageArgs | None = None,
        tolerance: VerifyTolerance | None = None,
    ) -> OptimizeOutcome:
        """Optimize ``source`` into ``out_dir`` (an empty folder) without blocking the event loop.
        If the caller is cancelled (client gone, shutdown), the child is killed."""
        job = _Job()
        try:
            return await asyncio.to_thread(
                self.run_sync, source, out_dir, variants=variants, verify=verify, image=image,
                tolerance=tolerance, job=job,
            )
        except asyncio.CancelledError:
            job.cancel()
            raise

    def run_sync(
        self,
        source: Path,
        out_dir: Path,
        *,
        variants: frozenset[str],
        verify: bool,
        image: ImageArgs | None = None,
        tolerance: VerifyTolerance | None = None,
        job: _Job | None = None,
    ) -> OptimizeOutcome:
        started = time.monotonic()
        command = [
            sys.executable, "-m", "service.registry.sandbox", str(source), str(out_dir),
            "--variants", ",".join(sorted(variants)), "--verify", str(int(verify)), *_tolerance_argv(tolerance),
            "--memory-limit-mb", str(self.memory_limit_mb), *(image.argv() if image is not None else ()),
            *(("--fused-ops-library", self.fused_ops_library) if self.fused_ops_library else ()),
        ]  # fmt: skip
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_child_env(),
            start_new_session=True,
        )
        with self._lock:
            self._live.add(proc)
        if job is not None:
            job.started(proc)
        try:
            try:
                output, _ = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill(proc)
                proc.communicate()
                raise OptimizationError(
                    f"optimization timed out after {self.timeout_s:g} s (limit: SERVICE_OPTIMIZER_TIMEOUT_S)"
                ) from None
        finally:
            with self._lock:
                self._live.discard(proc)
        elapsed = time.monotonic() - started
        return _read_result(out_dir, proc.returncode, output, elapsed, self.memory_limit_mb, source)

    def kill_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for proc in live:
            _kill(proc)


# ---------------------------------------------------------------------- parent side helpers


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    project_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (project_root, env.get("PYTHONPATH", "")) if p)
    # Few malloc arenas and few threads keep the reserved address space close to what is really used.
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _read_result(
    out_dir: Path, returncode: int, output: bytes, duration_s: float, limit_mb: int, source: Path | None = None
) -> OptimizeOutcome:
    tail = output[-_OUTPUT_TAIL:].decode("utf-8", "replace")
    try:
        result = json.loads((out_dir / RESULT).read_bytes())
    except (OSError, ValueError):
        result = None
    if not isinstance(result, dict) and returncode == EXIT_NO_SPACE:
        raise InsufficientStorageError("not enough disk space to optimize the model")
    if not isinstance(result, dict):
        log.warning("optimizer child exited with %s without a result; output tail:\n%s", returncode, tail)
        if returncode in (-signal.SIGKILL, -signal.SIGSEGV, -signal.SIGABRT) or looks_like_oom(tail):
            raise OptimizationError(
                f"optimization exceeded the memory limit of {limit_mb} MiB or crashed "
                "(limit: SERVICE_OPTIMIZER_MEMORY_MB)"
            )
        raise OptimizationError(f"optimization failed: the optimizer process exited with status {returncode}")
    if not result.get("ok"):
        if result.get("error") == "memory":
            raise OptimizationError(
                f"optimization exceeded the memory limit of {limit_mb} MiB (limit: SERVICE_OPTIMIZER_MEMORY_MB)"
            )
        error = _ERRORS.get(str(result.get("error")), OptimizationError)
        raise error(client_message(str(result.get("message") or "optimization failed"), out_dir, source))
    for name, why in (result.get("skipped_variants") or {}).items():
        log.warning("optimized without the %s variant: %s", name, why)
    return OptimizeOutcome(
        out_dir=out_dir,
        sha256=result["sha256"],
        size=result["size"],
        signature=result["signature"],
        variants=result["variants"],
        duration_s=duration_s,
    )


def client_message(text: str, *private: Path | None) -> str:
    """A child's error message as a client may see it: without the server's folders (staging, store,
    project, Python installation) or source-file locations that library messages (ONNX Runtime's
    ``/onnxruntime_src/...cc:123``) carry, and bounded in length."""
    folders = {str(p) for p in private if p is not None}
    folders |= {str(p.parent) for p in private if p is not None}
    folders |= {sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parents[2])}
    for folder in sorted((f for f in folders if len(f) > 1), key=len, reverse=True):
        text = re.sub(re.escape(folder) + r"[^\s'\"]*", "<file>", text)
    text = _SIGNATURE_RE.sub("", _SOURCE_PATH_RE.sub("", text)).strip()
    return text if len(text) <= 500 else text[:497] + "..."


def _tolerance_argv(tolerance: VerifyTolerance | None) -> list[str]:
    """``--rtol``/``--atol`` for the fields a model set; none for the rest, which the child then takes from
    the graph's precision (so "the default" and "the model's own" stay apart across the command line)."""
    if tolerance is None:
        return []
    pairs = (("--rtol", tolerance.rtol), ("--atol", tolerance.atol))
    return [arg for flag, value in pairs if value is not None for arg in (flag, repr(value))]


# ---------------------------------------------------------------------- child side


def _limit_resources(memory_limit_mb: int) -> None:
    import resource

    limit = memory_limit_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(Exception):  # Linux: die with the parent, never orphaned
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


def _job(
    source: Path, out_dir: Path, *, variants: frozenset[str], verify: bool, preprocess: str | None = None,
    label_count: int | None = None, rtol: float | None = None, atol: float | None = None,
    fused_ops_library: str | None = None,
) -> dict[str, Any]:
    import hashlib

    from service.imaging.config import Preprocess
    from service.optimizer.verify_shared import shared_reference_runs
    from service.registry.acceptance import accepted_model
    from service.registry.image_config import check_labels, image_normalization
    from service.registry.variants import optimize_variants
    from service.runtime.contract import Signature

    data = source.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    model = accepted_model(data)
    del data
    uploaded = Signature.from_onnx(model)
    normalization = image_normalization(uploaded, None if preprocess is None else Preprocess.model_validate_json(
        preprocess))
    check_labels(uploaded, label_count)
    options = {"verify": verify, "rtol": rtol, "atol": atol, "input_normalization": normalization,
               "fused_ops_library": fused_ops_library}
    with shared_reference_runs():  # the variants' verifications run the original once per input set
        signature, made = optimize_variants(model, variants, options, out_dir)
    return _result(digest, source, signature, made)


def _result(digest: str, source: Path, signature: Any, variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "ok": True,
        "sha256": digest,
        "size": source.stat().st_size,
        "signature": signature.to_dict(),
        "variants": {name: entry for name, entry in variants.items() if "file" in entry},
        "skipped_variants": {name: entry["skipped"] for name, entry in variants.items() if "file" not in entry},
    }


def _failure(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, MemoryError) or looks_like_oom(f"{type(exc).__name__} {exc}"):
        return {"ok": False, "error": "memory", "message": "memory limit exceeded"}
    if isinstance(exc, ServiceError):
        return {"ok": False, "error": type(exc).__name__, "message": exc.message}
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message = "not enough disk space to optimize the model"
        return {"ok": False, "error": "InsufficientStorageError", "message": message}
    return {"ok": False, "error": "OptimizationError", "message": f"optimizer failed ({type(exc).__name__})"}


def _variant_list(text: str) -> frozenset[str]:
    names = frozenset(filter(None, text.split(",")))
    if not names or not names <= {"fused", "plain", VARIANT}:
        raise argparse.ArgumentTypeError(f"variants are fused, plain and/or {VARIANT}, not {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.registry.sandbox")
    parser.add_argument("source", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--variants", type=_variant_list, default=frozenset({"fused", "plain"}),
                        help="the optimized variants to make: fused, plain or both (comma-separated)")
    parser.add_argument("--verify", type=int, choices=(0, 1), default=1)
    parser.add_argument("--fused-ops-library", default=None, help=f"the library the {VARIANT} variant needs")
    parser.add_argument("--memory-limit-mb", type=int, required=True)
    parser.add_argument("--preprocess", default=None, help="Preprocess (JSON) of an image model")
    parser.add_argument("--label-count", type=int, default=None, help="labels of the model's first output")
    parser.add_argument("--rtol", type=float, default=None, help="verification tolerance, relative (default: by "
                        "the graph's precision)")
    parser.add_argument("--atol", type=float, default=None, help="verification tolerance, absolute (default: by "
                        "the graph's precision)")
    args = parser.parse_args(argv)
    _limit_resources(args.memory_limit_mb)
    logging.basicConfig(level=logging.WARNING, format="optimizer-worker: %(levelname)s %(message)s")
    try:
        result = _job(args.source, args.out_dir, variants=args.variants, verify=bool(args.verify),
                      preprocess=args.preprocess, label_count=args.label_count, rtol=args.rtol, atol=args.atol,
                      fused_ops_library=args.fused_ops_library)
    except BaseException as exc:  # report every failure as data; the parent turns it into a 4xx
        if not isinstance(exc, ServiceError | MemoryError):
            logging.getLogger(__name__).warning("optimization failed", exc_info=True)
        result = _failure(exc)
        _discard_variants(args.out_dir)  # a half-written copy only takes the space the report needs
    try:
        write_synced(args.out_dir / RESULT, json.dumps(result).encode())
    except MemoryError:
        return 3
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return EXIT_NO_SPACE
        raise
    return 0


def _discard_variants(out_dir: Path) -> None:
    for name in (FUSED_FILE, PLAIN_FILE, KERNELS_FILE):
        with contextlib.suppress(OSError):
            (out_dir / name).unlink()


if __name__ == "__main__":
    sys.exit(main())
