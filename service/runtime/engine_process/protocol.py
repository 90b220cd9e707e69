"""The messages between a worker and the engine process: typed, one pickle each.

A connection's first message is ``Load`` (answered ``Loaded`` or ``Failed``); then any number of ``Run``
(answered ``Ran`` or ``Failed``); ``Close`` ends it (answered ``Closed``). Tensors never travel in a message:
a ``Run`` names the worker's shared buffer and the layout of the batch in it, a ``Ran`` the engine process's
buffer and the layout of the outputs (``shared_buffer``). Only plain values travel, so plain ``pickle``
serves (multiprocessing's ``Connection.send`` pickles with ForkingPickler, which copies its reducer table on
every call: 6 against 1.5 us on the CPU machine).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from service import errors
from service.errors import EngineError, ServiceError
from service.runtime.contract import Signature
from service.runtime.engine_process.shared_buffer import Layout
from service.runtime.loads import LoadRequest
from service.runtime.phases import LoadPhases

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    request: LoadRequest


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    buffer: str
    layout: Layout
    rows: int


@dataclasses.dataclass(frozen=True, slots=True)
class Close:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Loaded:
    """What a worker learns of the engine it loaded (``phases``: how its load went in the engine process)."""

    signature: Signature
    max_batch_size: int
    provider: str
    variant: str
    record: dict[str, Any]
    description: dict[str, Any]
    phases: LoadPhases = dataclasses.field(default_factory=LoadPhases)


@dataclasses.dataclass(frozen=True, slots=True)
class Ran:
    buffer: str
    layout: Layout
    engine_s: float
    """The engine call's own time (shared by the batch it was merged into)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Closed:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """An error for the worker: a ServiceError keeps its class; anything else arrives as an EngineError."""

    error: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        if isinstance(exc, ServiceError):
            return cls(type(exc).__name__, str(exc))
        log.error("engine call failed: %s: %s", type(exc).__name__, exc)
        return cls("EngineError", f"inference failed in the engine process ({type(exc).__name__})")

    def exception(self) -> ServiceError:
        """The ServiceError it names (an EngineError when the name is not one of ours)."""
        kind = getattr(errors, self.error, None)
        if isinstance(kind, type) and issubclass(kind, ServiceError):
            try:
                return kind(self.message)
            except TypeError:
                pass
        return EngineError(self.message)


Message = Load | Run | Close | Loaded | Ran | Closed | Failed
M = TypeVar("M")


class ProtocolError(EngineError):
    """The other side sent something that is not a message of this protocol."""


def send(conn: Connection, message: Message) -> None:
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection, *kinds: type[M]) -> M:
    """The next message, which must be one of ``kinds`` (ProtocolError otherwise; EOFError/OSError when the
    connection ended)."""
    message = pickle.loads(conn.recv_bytes())
    if not isinstance(message, kinds):
        raise ProtocolError(f"unexpected engine-process message {type(message).__name__}")
    return message


__all__ = ["Close", "Closed", "Failed", "Load", "Loaded", "Message", "ProtocolError", "Ran", "Run", "receive", "send"]
