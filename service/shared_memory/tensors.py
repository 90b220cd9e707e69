"""One request's tensors in shared memory: inputs read from regions, outputs written into them.

A tensor names its region in its parameters, as tritonclient's ``set_shared_memory`` writes them:
``shared_memory_region``, ``shared_memory_byte_size`` and (optional) ``shared_memory_offset``. Every bound is
checked before a byte is touched: the tensor's bytes (datatype x shape) must equal an input's byte size, and
the byte range must lie inside the region; an output's result must fit its byte size (a 400 after the
inference, as Triton answers). A system input is read from its region's file into an array of the server's
while the request is decoded (one copy, as a tensor in the body costs; a file the client shrank meanwhile is a
400, never a signal); a CUDA input stays on the device (``DeviceRows``).

The regions are leased for the request's life (``RegionUse`` is a context manager, one per request); CUDA
regions also for the life of their ``DeviceRows``, which a cancelled request may leave with the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import numpy as np

from service.errors import BadRequestError, InvalidInputError
from service.runtime.contract import NUMPY_TO_KSERVE
from service.runtime.device_rows import DeviceRows
from service.shared_memory.regions import CudaRegion, Region
from service.shared_memory.table import SharedMemory

REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
_KEYS = {REGION, BYTE_SIZE, OFFSET}


def names_region(params: Mapping[str, Any]) -> bool:
    """Whether a tensor's parameters point at shared memory."""
    return any(key.startswith("shared_memory") for key in params)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one tensor lies: ``byte_size`` bytes at ``offset`` in ``region``."""

    region: Region
    offset: int
    byte_size: int

    @property
    def name(self) -> str:
        return self.region.record.name


class RegionUse:
    """The regions one request reads and writes (see the module docstring)."""

    def __init__(self, table: SharedMemory) -> None:
        self.table = table
        self._leased: dict[str, Region] = {}
        self.outputs: dict[str, Slot] = {}
        """Requested output name -> where it goes."""

    def slot(self, params: Mapping[str, Any], where: str) -> Slot:
        unknown = sorted(key for key in params if key.startswith("shared_memory") and key not in _KEYS)
        if unknown:
            raise BadRequestError(f"{where}: unknown parameter {unknown[0][:40]!r}")
        name = params.get(REGION)
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"{where}: {REGION} must name a registered region")
        if BYTE_SIZE not in params:
            raise BadRequestError(f"{where}: {BYTE_SIZE} is required with {REGION}")
        byte_size = _integer(params[BYTE_SIZE], f"{where}.{BYTE_SIZE}")
        offset = _integer(params.get(OFFSET, 0), f"{where}.{OFFSET}")
        region = self._lease(name)
        size = region.record.byte_size
        if offset + byte_size > size:
            raise BadRequestError(f"{where}: offset {offset} + byte size {byte_size} is past the end of shared "
                                  f"memory region {name!r} ({size} bytes)")
        return Slot(region, offset, byte_size)

    def input(self, params: Mapping[str, Any], where: str, name: str, dtype: np.dtype, shape: list[int]) -> np.ndarray:
        """The input tensor ``name`` (datatype and shape already checked against the model) from its region."""
        slot = self.slot(params, where)
        needed = math.prod(shape) * dtype.itemsize
        if slot.byte_size != needed:
            raise InvalidInputError(f"input {name!r}: {BYTE_SIZE} is {slot.byte_size} bytes but shape {shape} of "
                                    f"{NUMPY_TO_KSERVE[dtype]} needs {needed}")
        array = slot.region.read(slot.offset, dtype.newbyteorder("<"), tuple(shape))
        if isinstance(array, DeviceRows):  # the engine may still read it after the request ends (cancelled)
            _hold_while_alive(self.table, slot.region, array)
        return array if array.dtype.isnative else array.astype(dtype)

    def output(self, params: Mapping[str, Any], where: str, name: str) -> None:
        self.outputs[name] = self.slot(params, where)

    async def write_outputs(self, outputs: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
        """Each output that has a slot written into it; returns its response parameters by output name."""
        placed = {name: outputs[name] for name in self.outputs if name in outputs}
        for name, value in placed.items():
            slot = self.outputs[name]
            if value.dtype == object or value.nbytes > slot.byte_size:
                raise BadRequestError(f"shared memory size specified with the request for output {name!r} should be "
                                      f"at least {value.nbytes} bytes to hold the results")
        for name, value in placed.items():
            slot = self.outputs[name]
            wire = value if value.dtype.byteorder != ">" else value.astype(value.dtype.newbyteorder("<"))
            if isinstance(slot.region, CudaRegion):  # a copy to the device: here unless a graph capture would
                if not slot.region.write(slot.offset, wire, wait=False):  # make the event loop wait for it
                    await asyncio.to_thread(slot.region.write, slot.offset, wire)
            else:
                slot.region.write(slot.offset, wire)
        return {name: self._parameters(self.outputs[name], value.nbytes) for name, value in placed.items()}

    @staticmethod
    def _parameters(slot: Slot, nbytes: int) -> dict[str, Any]:
        params: dict[str, Any] = {REGION: slot.name, BYTE_SIZE: nbytes}
        if slot.offset:
            params[OFFSET] = slot.offset
        return params

    def _lease(self, name: str) -> Region:
        region = self._leased.get(name)
        if region is None:
            region = self._leased[name] = self.table.lease(name)
        return region

    def release(self) -> None:
        for region in self._leased.values():
            self.table.release(region)
        self._leased = {}

    def __enter__(self) -> RegionUse:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.release()


def shared_input(regions: RegionUse | None, params: Mapping[str, Any], where: str, name: str, dtype: np.dtype,
                 shape: list[int]) -> np.ndarray:
    """An input read from the shared-memory region its parameters name (REST and gRPC)."""
    if regions is None:
        raise BadRequestError(f"{where}: the shared-memory extensions are not available here")
    return regions.input(params, where, name, dtype, shape)


def shared_output(regions: RegionUse | None, params: Mapping[str, Any], where: str, name: str) -> None:
    """A requested output to be written into the shared-memory region its parameters name (REST and gRPC)."""
    if regions is None:
        raise BadRequestError(f"{where}: the shared-memory extensions are not available here")
    if "classification" in params:
        raise BadRequestError(f"{where}: the classification extension cannot write to shared memory")
    regions.output(params, where, name)


def _hold_while_alive(table: SharedMemory, region: Region, rows: np.ndarray) -> None:
    """A second lease of ``region``, ended when ``rows`` is garbage (whichever thread drops it last)."""
    table.hold(region)
    weakref.finalize(rows, table.release, region)


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequestError(f"{where} must be a non-negative integer")
    return value
