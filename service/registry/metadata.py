"""What the store keeps about each model version (``metadata.json``), typed and versioned.

``VersionMetadata.parse`` reads what any release wrote: a file without ``schema_version`` is schema 1 (the
release before typed metadata), whose fields are those of schema 2, so migrating it means stamping the
version; the manager writes the migrated record back at start. Unknown fields are dropped, missing
required ones refuse the version (it is marked FAILED, the others serve). The tuner's records stay free-form
dicts: their schema belongs to ``runtime.tuner``, which checks what it reuses. ``engines`` keeps one record per
GPU model and ONNX Runtime version (``engine_key``), so replicas on different GPUs sharing a store each reuse
their own choice and never overwrite another's; ``engine`` is the record this process serves with (on disk:
the last one recorded, which is all a release before ``engines`` reads). A file without ``engines`` gets it
from ``engine``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.errors import UnprocessableError, printable
from service.model_config import ModelConfig
from service.registry.store import ORIGINAL
from service.runtime.contract import Signature
from service.runtime.loads import stored_record

SCHEMA_VERSION = 2


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class OriginalRecord(_Record):
    file: str = ORIGINAL
    sha256: str
    size: int


class TensorRecord(_Record):
    name: str
    datatype: str
    shape: list[int]


class VariantRecord(_Record):
    """One optimized graph of the version (e.g. "fused", "plain") and its optimization report."""

    file: str
    sha256: str
    report: dict[str, Any]


class OptimizationRecord(_Record):
    cache_key: str
    """Original sha256 + optimizer version + graph settings: the optimized files are reused while it matches."""
    optimizer_version: str
    fields: dict[str, Any]
    optimized_at: str
    duration_s: float
    variants: dict[str, VariantRecord]
    made_for: list[str] | None = Field(None, exclude_if=lambda value: value is None)
    """The variants the optimizer was asked for ("fused", "plain"): a graph FusedConv leaves unchanged is
    stored once, as "plain". None: a release that made every variant."""

    @property
    def made_for_set(self) -> frozenset[str]:
        return frozenset(self.made_for) if self.made_for is not None else frozenset({"fused", "plain"})


class VersionMetadata(_Record):
    schema_version: int = SCHEMA_VERSION
    name: str = ""
    version: int = 0
    created: str
    original: OriginalRecord
    inputs: list[TensorRecord]
    outputs: list[TensorRecord]
    config: ModelConfig = Field(default_factory=ModelConfig)
    optimization: OptimizationRecord | None = None
    engine: dict[str, Any] | None = None
    """The tuner's record of the engine choice this process serves with (None until the version was loaded)."""
    engines: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """The tuner's record for each device it was loaded on, by ``engine_key`` (without ``reused``)."""

    @model_validator(mode="before")
    @classmethod
    def _engines_from_engine(cls, data: Any) -> Any:
        if isinstance(data, dict) and "engines" not in data and isinstance(data.get("engine"), dict):
            return {**data, "engines": {engine_key(data["engine"]): stored_record(data["engine"])}}
        return data

    @classmethod
    def parse(cls, data: dict[str, Any]) -> VersionMetadata:
        """Any schema this release reads, migrated to the current one; UnprocessableError naming the problem
        (the version's FAILED state shows it)."""
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
            raise UnprocessableError(f"metadata schema {printable(version)} is newer than this release reads")
        try:
            return cls.model_validate({**data, "schema_version": SCHEMA_VERSION})
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "metadata"
            raise UnprocessableError(f"metadata field {where}: {first.get('msg', 'invalid')}") from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"config"}) | {"config": self.config.to_dict()}

    @property
    def signature(self) -> Signature:
        return Signature.from_dict({"inputs": [t.model_dump() for t in self.inputs],
                                    "outputs": [t.model_dump() for t in self.outputs]})

    def with_engine(self, record: dict[str, Any]) -> VersionMetadata:
        """Serving with ``record``; it becomes its device's record."""
        engines = {**self.engines, engine_key(record): stored_record(record)}
        return self.model_copy(update={"engine": record, "engines": engines})

    def records_engine(self, record: dict[str, Any]) -> bool:
        """``record`` is what is kept for its device already (so nothing needs writing)."""
        return self.engines.get(engine_key(record)) == stored_record(record)

    def with_optimization(self, record: OptimizationRecord) -> VersionMetadata:
        """A fresh optimization: every device's engine choice is made again."""
        return self.model_copy(update={"optimization": record, "engine": None, "engines": {}})

    def report(self) -> dict[str, Any] | None:
        """The optimization report of the variant being served (or the first one before loading), in the
        optimizer's current form (``OptimizationReport.from_dict`` reads what earlier optimizers wrote)."""
        from service.optimizer.report import OptimizationReport

        variants = self.optimization.variants if self.optimization is not None else {}
        chosen = ((self.engine or {}).get("choice") or {}).get("variant")
        entry = variants.get(chosen) if isinstance(chosen, str) else None
        entry = entry or next(iter(variants.values()), None)
        if entry is None:
            return None
        try:
            return OptimizationReport.from_dict(entry.report).to_dict()
        except (TypeError, ValueError):  # not a report this optimizer can read: shown as stored
            return entry.report


def engine_key(record: dict[str, Any]) -> str:
    """Which device a tuner record belongs to: the GPU model (or "cpu") and the ONNX Runtime version."""
    return f"{record.get('device')} | onnxruntime {record.get('ort_version')}"


def tensor_records(signature: Signature) -> dict[str, list[TensorRecord]]:
    data = signature.to_dict()
    return {key: [TensorRecord(**item) for item in data[key]] for key in ("inputs", "outputs")}


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def age_s(created: str) -> float | None:
    """Seconds since ``created`` (None when it is not a timestamp)."""
    try:
        return (dt.datetime.now(dt.UTC) - dt.datetime.fromisoformat(created)).total_seconds()
    except ValueError:
        return None
