"""What the store keeps about each model version (``metadata.json``), typed and versioned.

``VersionMetadata.parse`` reads what any release wrote: a file without ``schema_version`` is schema 1 (the
release before typed metadata), whose fields are those of schema 2, so migrating it means stamping the
version; the manager writes the migrated record back at start. Unknown fields are dropped, missing
required ones refuse the version (it is marked FAILED, the others serve). The tuner's record (``engine``)
stays a free-form dict: its schema belongs to ``runtime.tuner``, which checks what it reuses.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.errors import UnprocessableError, printable
from service.model_config import ModelConfig
from service.registry.store import ORIGINAL
from service.runtime.contract import Signature

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
    """The tuner's record of the engine choice (None until the version was first loaded)."""

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

    def with_engine(self, record: dict[str, Any] | None) -> VersionMetadata:
        return self.model_copy(update={"engine": record})

    def with_optimization(self, record: OptimizationRecord) -> VersionMetadata:
        """A fresh optimization: its engine choice is made again."""
        return self.model_copy(update={"optimization": record, "engine": None})

    def report(self) -> dict[str, Any] | None:
        """The optimization report of the variant being served (or the first one before loading)."""
        variants = self.optimization.variants if self.optimization is not None else {}
        chosen = ((self.engine or {}).get("choice") or {}).get("variant")
        entry = variants.get(chosen) if isinstance(chosen, str) else None
        entry = entry or next(iter(variants.values()), None)
        return None if entry is None else entry.report


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
