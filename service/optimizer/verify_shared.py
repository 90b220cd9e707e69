"""The original model's runs, shared by the verifications of several candidates of one original.

An upload may verify two optimized variants of one original (``registry.sandbox``: "fused" and "plain"). Both
draw the same input sets from the same seed (``verify_draws``), so the original's session, and its outputs for
each input set, are the same for both. Inside ``shared_reference_runs()`` verification keeps them, keyed by the
bytes of the model ONNX Runtime runs and of the inputs: the second candidate runs only itself. Outside it
nothing is kept, and a run is never taken for another model's or other inputs'.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

_active: contextvars.ContextVar[ReferenceRuns | None] = contextvars.ContextVar("reference_runs", default=None)


class ReferenceRuns:
    """Sessions by model bytes and their outputs (or errors) by (model, outputs asked, inputs)."""

    def __init__(self) -> None:
        self._sessions: dict[bytes, Any] = {}
        self._runs: dict[tuple, tuple[bool, Any]] = {}

    def session(self, data: bytes, make: Callable[[bytes], Any]) -> Any:
        key = _digest(data)
        if key not in self._sessions:
            self._sessions[key] = make(data)
        return self._sessions[key]

    def run(self, session: Any, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[Any]:
        key = (id(session), tuple(names), _feeds_digest(feeds))
        if key not in self._runs:
            try:
                self._runs[key] = (True, session.run(list(names), dict(feeds)))
            except Exception as exc:
                self._runs[key] = (False, exc)
        ok, value = self._runs[key]
        if not ok:
            raise value
        return value


@contextlib.contextmanager
def shared_reference_runs() -> Iterator[ReferenceRuns]:
    """Verifications inside share the original's sessions and runs (see the module docstring)."""
    runs = ReferenceRuns()
    token = _active.set(runs)
    try:
        yield runs
    finally:
        _active.reset(token)


def reference_session(data: bytes, make: Callable[[bytes], Any]) -> Any:
    """The session of the original (verification copy) ``data``: shared inside ``shared_reference_runs``."""
    runs = _active.get()
    return make(data) if runs is None else runs.session(data, make)


def reference_run(session: Any, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[Any]:
    """``session.run(names, feeds)``, shared inside ``shared_reference_runs`` (a failure is raised again)."""
    runs = _active.get()
    return session.run(list(names), dict(feeds)) if runs is None else runs.run(session, names, feeds)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=20).digest()


def _feeds_digest(feeds: Mapping[str, np.ndarray]) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    for name in sorted(feeds):
        array = np.ascontiguousarray(feeds[name])
        h.update(name.encode())
        h.update(array.dtype.str.encode())
        h.update(repr(array.shape).encode())
        h.update(memoryview(array).cast("B"))
    return h.digest()
