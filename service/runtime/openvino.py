"""The OpenVINO execution provider on the CPU, as ONNX Runtime's plugin EP ``onnxruntime-ep-openvino``.

Why: OpenVINO's CPU plugin ran MobileNetV3 and ResNet-50 faster than ORT's CPU provider on the machines we
measured (bench/cpu_engines.py). It ships as a library that ONNX Runtime (1.23 or later) loads at run time
(``register_execution_provider_library``), so it needs no other onnxruntime build and leaves onnxruntime-gpu
in place. It is optional (the ``openvino`` extra): without it, or where it offers no CPU device (the plugin
keeps only devices whose vendor is Intel), ``status()`` says why and ORT's CPU provider serves as before.

Precision (``load_config``): OpenVINO's CPU plugin computes in bf16 by default wherever the CPU has bf16
instructions (AVX512-BF16, AMX), and the EP's own ``precision=FP32`` did not change that: on an AMX Xeon
ResNet-50 differed from ORT's CPU provider by 1e-1 (relative L2) with it, exactly as in bf16. So the precision
is set with OpenVINO's property ``INFERENCE_PRECISION_HINT`` through the EP's ``load_config`` option; with
``f32`` the difference was 1.8e-5. bf16 is offered only where the CPU has bf16 instructions (elsewhere the hint
would run f32 under a bf16 label).

Check (``cpu_tuner.check_openvino``, before a candidate is timed): OpenVINO against ORT's CPU provider in fp32
on random inputs, relative L2 error below ``REL_L2_TOLERANCE`` for every output and top-1 unchanged on every
clear-cut row of a classifier output (precision.check_fp16's rule); a candidate that fails is not served.
- fp32: 1e-3. Measured on an AMX Xeon: 3e-6 (MobileNetV3), 1.8e-5 (ResNet-50); a graph OpenVINO computes
  wrongly (or ORT partitions wrongly) is caught, and bf16 (1e-1) cannot pass as fp32.
- bf16: 0.15. bf16 keeps 8 significant bits where fp16 keeps 11, so its rounding is 8x coarser than fp16's
  (whose bound is 5e-2); OpenVINO accumulates in fp32. Measured on the Xeon with the zoo's random-weight
  networks (calibrated BatchNorm; deep random nets amplify rounding more than trained ones): MobileNetV3
  3.7e-2..5.2e-2, ResNet-50 9.8e-2..1.1e-1. A broken conversion (overflow, values flushed to zero) gives
  errors of order 1.

Threads: OpenVINO's ``INFERENCE_NUM_THREADS`` (again through ``load_config``) is ``cpu_threads`` when set (0:
OpenVINO's default, every core the process may use). The plugin ignores the EP's own ``num_of_threads`` (it says
so in a warning): with it set to 1, ResNet-50 still kept 4 pinned cores busy; with INFERENCE_NUM_THREADS 1 and 2,
the process's CPU time per wall second was 1.0 and 2.0. The ORT session around it keeps one intra-op thread
that does not spin: OpenVINO runs the graph on its own threads, and ORT's pool, spinning after each run, would
only compete with them for cores.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import threading
from typing import Any

import onnxruntime as ort

from service.errors import EngineError, first_line
from service.runtime.contract import EngineOptions
from service.runtime.device import DeviceChoice, cpu_info
from service.runtime.sessions import session_options

log = logging.getLogger(__name__)

OPENVINO = "OpenVINOExecutionProvider"
PLUGIN = "onnxruntime-ep-openvino"
PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16"}
"""Our precision name -> OpenVINO's INFERENCE_PRECISION_HINT."""
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of CPUs with bf16 instructions (either suffices)."""
REL_L2_TOLERANCE = {"fp32": 1e-3, "bf16": 0.15}
"""Largest relative L2 error against ORT's CPU provider in fp32, per precision (see the module docstring)."""
_REGISTRATION = "onnx-cnn-serve-openvino"
_lock = threading.Lock()
_status: OpenVinoStatus | None = None


@dataclasses.dataclass(frozen=True)
class OpenVinoStatus:
    """Whether the OpenVINO EP can serve on this CPU, and the human reason (for the tuner's record)."""

    usable: bool
    reason: str
    version: str | None = None
    """The plugin's version (part of the tuner's cache key: a new OpenVINO may be faster or slower)."""
    bf16: bool = False
    """The CPU has bf16 instructions (OpenVINO computes bf16 natively)."""
    device: Any = dataclasses.field(default=None, repr=False, compare=False)
    """The ``OrtEpDevice`` of OpenVINO's CPU device (never pickled: each process finds its own)."""


def status() -> OpenVinoStatus:
    """Load the plugin into this process once (the answer is kept); never raises."""
    global _status
    with _lock:
        if _status is None:
            _status = _probe()
            log.info("OpenVINO EP: %s", _status.reason)
        return _status


def _probe() -> OpenVinoStatus:
    try:
        import onnxruntime_ep_openvino as plugin
    except ImportError:
        return OpenVinoStatus(False, f"the OpenVINO EP plugin is not installed (pip install {PLUGIN})")
    version = importlib.metadata.version(PLUGIN)
    if not hasattr(ort, "register_execution_provider_library"):
        return OpenVinoStatus(False, f"onnxruntime {ort.__version__} cannot load EP plugins (1.23 or later can)")
    try:
        ort.register_execution_provider_library(_REGISTRATION, plugin.get_library_path())
        devices = [d for d in ort.get_ep_devices() if d.ep_name == OPENVINO and d.ep_metadata.get("ov_device") == "CPU"]
    except Exception as exc:  # a plugin that does not load leaves ORT's CPU provider serving
        return OpenVinoStatus(False, f"the OpenVINO EP plugin {version} did not load: {first_line(exc)}", version)
    name, flags = cpu_info()
    if not devices:
        return OpenVinoStatus(False, f"the OpenVINO EP plugin {version} offers no device for this CPU ({name}; "
                                     "it serves Intel CPUs only)", version)
    bf16 = any(flag in flags for flag in BF16_FLAGS)
    return OpenVinoStatus(True, f"OpenVINO EP {version} on {name}" + (" (bf16 instructions)" if bf16 else ""),
                          version, bf16, devices[0])


def provider_options(precision: str, threads: int) -> dict[str, str]:
    """The EP's options for one session: OpenVINO's precision hint and threads (see the module docstring)."""
    if precision not in PRECISION_HINTS:
        raise ValueError(f"OpenVINO precision must be one of {sorted(PRECISION_HINTS)}, not {precision!r}")
    properties = {"INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision]}
    if threads:
        properties["INFERENCE_NUM_THREADS"] = str(threads)
    return {"load_config": json.dumps({"CPU": properties})}


def openvino_session(data: bytes, engine_options: EngineOptions, precision: str) -> ort.InferenceSession:
    """A session whose graph OpenVINO runs (what it cannot take stays on ORT's CPU provider: ``ep_nodes``)."""
    found = status()
    if not found.usable:
        raise EngineError(f"the OpenVINO EP is not usable: {found.reason}")
    options = session_options()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    options.add_provider_for_devices([found.device], provider_options(precision, engine_options.cpu_threads))
    try:
        session = ort.InferenceSession(data, options)
    except Exception as exc:
        raise EngineError(f"could not load the model on {OPENVINO}: {first_line(exc)}") from exc
    if session.get_providers()[0] != OPENVINO:
        raise EngineError(f"onnxruntime did not start {OPENVINO} for this model")
    return session


def ep_nodes(session: ort.InferenceSession) -> dict[str, int] | None:
    """Nodes per execution provider after ORT's partitioning (None where ORT does not record it)."""
    try:
        assigned = session.get_provider_graph_assignment_info()
    except (AttributeError, RuntimeError):  # an onnxruntime before 1.23, or recording was off
        return None
    counts: dict[str, int] = {}
    for subgraph in assigned:
        counts[subgraph.ep_name] = counts.get(subgraph.ep_name, 0) + len(subgraph.get_nodes())
    return counts


def openvino_choice(choice: DeviceChoice) -> DeviceChoice:
    """The device choice of an OpenVINO session: its provider, and the plugin and CPU in the reason."""
    return DeviceChoice(OPENVINO, choice.device_id, f"{status().reason}; {choice.reason}")

