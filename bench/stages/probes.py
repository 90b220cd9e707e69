"""Stage probes: the server's functions wrapped so that callgrind counts each request stage's instructions apart.

Loaded into every process of the server by ``site/sitecustomize.py`` when ``STAGE_MARKS_LIB`` names the built
``marks.c`` (see bench/request_stages.py). Each probed function marks its entry and its exit; a mark asks
callgrind to dump what it counted since the previous mark, labelled with the stage that was open meanwhile:
the innermost probed call still running, on any thread (``outside`` when none is). Nested stages therefore
carve their instructions out of the stage around them, and the engine thread's work while the event loop
waits for it is the engine's, not the loop's. A stage is a list of (module, attribute) call sites: a function
imported by name is probed where it is called from, a method on its class.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import inspect
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

STAGES: dict[str, list[tuple[str, str]]] = {
    "http parse, head guard": [("service.server.http_guard", "_Guard.data_received"),
                               ("service.server.http_guard", "_Guard.on_response_complete"),
                               ("service.server.inline_body", "InlineReading.get_buffer"),
                               ("service.server.inline_body", "InlineReading.buffer_updated")],
    "asgi cycle, middleware, route": [("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.run_asgi")],
    "handler glue": [("service.api.v2", "handle_infer")],
    "body receive": [("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.receive"),
                     ("service.server.inline_body", "InlineBody.receive"),
                     ("service.server.inline_body", "InlineBody.view")],
    "read body": [("service.api.v2", "read_body")],
    "trace, metrics, statistics": [("service.api.inference", "Observed.__aenter__"),
                                   ("service.api.inference", "Observed.__aexit__"),
                                   ("service.runtime.batcher", "Batcher._report_batch")],
    "model lookup": [("service.dataplane", "DataPlane.model_for_infer")],
    "decode": [("service.api.v2", "decode_v2_request")],
    "queue, hand-over, wake-up": [("service.api.inference", "infer")],
    "engine thread: split rows": [("service.runtime.batcher", "Batcher._compute")],
    "engine: copy in, out": [("service.runtime.engine", "OrtEngine.run_parts")],
    "ORT session run": [("onnxruntime.capi.onnxruntime_inference_collection", "Session.run"),
                        ("onnxruntime.capi.onnxruntime_inference_collection", "Session.run_with_iobinding")],
    "encode": [("service.api.v2", "encode_v2_response")],
    "response object, write": [("starlette.responses", "Response.__call__")],
    "response send (uvicorn)": [("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.send")],
    # workers and the engine process
    "engine-process client: layout, shared buffer": [("service.runtime.engine_process.client",
                                                      "RemoteEngine.run_parts")],
    "engine-process round trip: message, wait": [("service.runtime.engine_process.client", "RemoteEngine._call")],
    "host: wait, wake-up": [("service.runtime.engine_process.host", "HostedEngine._serve_once")],
    "host: read message, attach buffer": [("service.runtime.engine_process.host", "HostedEngine._read")],
    "host: merge, engine call": [("service.runtime.engine_process.host", "HostedEngine._execute")],
    "host: write outputs, reply": [("service.runtime.engine_process.host", "_Client.reply")],
}
OUTSIDE = "outside"


class Marks:
    """The open stages (a list: calls on several threads interleave) and the callgrind mark, made only once
    ``SIGUSR2`` has switched marking on (a dump per mark during the warm-up would only cost time)."""

    def __init__(self, library: str) -> None:
        self._mark = ctypes.CDLL(library).stage_mark
        self._mark.argtypes = [ctypes.c_char_p]
        self._open: list[bytes] = []
        self._lock = threading.Lock()
        self.on = False
        signal.signal(signal.SIGUSR2, self._switch_on)

    def _switch_on(self, *_: Any) -> None:
        self.on = True

    def _dump(self) -> None:
        if self.on:
            self._mark(self._open[-1] if self._open else OUTSIDE.encode())

    def enter(self, label: bytes) -> None:
        with self._lock:
            self._dump()
            self._open.append(label)

    def leave(self, label: bytes) -> None:
        with self._lock:
            self._dump()
            for index in range(len(self._open) - 1, -1, -1):
                if self._open[index] == label:
                    del self._open[index]
                    break


def _probed(function: Callable[..., Any], label: bytes, marks: Marks) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(function):
        @functools.wraps(function)
        async def probed_async(*args: Any, **kwargs: Any) -> Any:
            marks.enter(label)
            try:
                return await function(*args, **kwargs)
            finally:
                marks.leave(label)
        return probed_async

    @functools.wraps(function)
    def probed(*args: Any, **kwargs: Any) -> Any:
        marks.enter(label)
        try:
            return function(*args, **kwargs)
        finally:
            marks.leave(label)
    return probed


def install(library: str) -> list[str]:
    """Wrap every call site of ``STAGES`` that imports here; returns those that did not (a module this process
    never loads, such as the engine process's in a one-process server, is skipped)."""
    marks = Marks(library)
    missing = []
    for stage, sites in STAGES.items():
        for module_name, attribute in sites:
            try:
                owner: Any = importlib.import_module(module_name)
                *path, name = attribute.split(".")
                for part in path:
                    owner = getattr(owner, part)
                function = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            except (ImportError, AttributeError, KeyError):
                missing.append(f"{module_name}:{attribute}")
                continue
            setattr(owner, name, _probed(function, stage.encode(), marks))
    return missing


def install_from_environment() -> None:
    library = os.environ.get("STAGE_MARKS_LIB")
    if library:
        missing = install(library)
        if missing:
            print(f"stage probes not installed: {', '.join(missing)}", flush=True)
