"""The optimizations a server process runs: the sandboxed optimizer, the records it leaves, and refreshing a
stored version whose optimized files are stale.

At most ``MAX_CONCURRENT`` optimizer children run at once (each may use ``optimizer_memory_mb``); more wait.
A stored version's optimized files are reused while their cache key (original's sha256 + optimizer version +
graph settings) and checksums match (``cache_valid``); otherwise ``refresh`` optimizes it again under the
version's optimize lock, so of several processes sharing the store one does the work and the others, once the
lock is theirs, find the fresh files and reuse them. A store that refuses the writes fails the version with
the cause.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from service.errors import InsufficientStorageError, OptimizationError, ServiceError, UnprocessableError, storage_error
from service.model_config import EffectiveConfig, ModelConfig
from service.registry.locks import exclusive_async
from service.registry.metadata import (
    OptimizationRecord,
    OriginalRecord,
    VariantRecord,
    VersionMetadata,
    now_iso,
    tensor_records,
)
from service.registry.sandbox import ImageArgs, OptimizeOutcome, OptimizerRunner
from service.registry.store import ORIGINAL, ModelStore, cache_key, sha256_file
from service.registry.version import ModelVersion
from service.runtime.contract import Signature
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

MAX_CONCURRENT = 2


def image_args(config: EffectiveConfig) -> ImageArgs | None:
    """What the optimizer child checks and folds for an image model (None: not one)."""
    labels = config.postprocess.labels if config.postprocess is not None else None
    if config.preprocess is None and labels is None:
        return None
    return ImageArgs(preprocess=None if config.preprocess is None else config.preprocess.model_dump_json(),
                     label_count=None if labels is None else len(labels))


class Optimizations:
    """``check_accepting`` raises ShuttingDownError once the server stops (a killed child then says so).
    ``variants``: the optimized variants this server's tuner can choose among (``runtime.tuner.
    choosable_variants``); the others are not made, and stored files made without one of them are stale."""

    def __init__(self, settings: ServiceSettings, store: ModelStore, check_accepting: Callable[[], None],
                 variants: frozenset[str]) -> None:
        self._store = store
        self.variants = variants
        self._check_accepting = check_accepting
        self._runner = OptimizerRunner(timeout_s=settings.optimizer_timeout_s,
                                       memory_limit_mb=settings.optimizer_memory_mb,
                                       fused_ops_library=settings.fused_ops_library_file)
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self.count = 0
        """Optimizer runs (child processes) started."""

    def kill_all(self) -> None:
        self._runner.kill_all()

    async def run(self, source: Path, out_dir: Path, config: EffectiveConfig, what: str) -> OptimizeOutcome:
        """Optimize ``source`` into ``out_dir`` in the sandbox."""
        async with self._slots:
            self._check_accepting()
            self.count += 1
            log.info("optimizing %s", what)
            try:
                return await self._runner.run(source, out_dir, variants=self.to_make(config), verify=config.verify,
                                              image=image_args(config), tolerance=config.verify_tolerance)
            except OptimizationError:
                self._check_accepting()  # killed by stop(): say so rather than "crashed"
                raise

    def to_make(self, config: EffectiveConfig) -> frozenset[str]:
        """The variants a version with ``config`` gets here: what this server can serve, without "fused" where
        the config allows no FusedConv (then "plain" always)."""
        return self.variants if config.fused_conv else (self.variants - {"fused"}) | {"plain"}

    def record(self, outcome: OptimizeOutcome, config: EffectiveConfig) -> OptimizationRecord:
        """Runs in a thread (hashes the optimized files)."""
        from service.optimizer import OPTIMIZER_VERSION

        variants = {
            name: VariantRecord(file=entry["file"], sha256=sha256_file(outcome.out_dir / entry["file"]),
                                report=entry["report"])
            for name, entry in outcome.variants.items()
        }
        return OptimizationRecord(
            cache_key=cache_key(outcome.sha256, OPTIMIZER_VERSION, config.graph_fields()),
            optimizer_version=OPTIMIZER_VERSION, fields=config.graph_fields(), optimized_at=now_iso(),
            duration_s=round(outcome.duration_s, 3), variants=variants, made_for=sorted(self.to_make(config)),
        )

    def new_metadata(
        self, outcome: OptimizeOutcome, config: ModelConfig, effective: EffectiveConfig
    ) -> VersionMetadata:
        """A new version's metadata (runs in a thread)."""
        return VersionMetadata(
            created=now_iso(),
            original=OriginalRecord(sha256=outcome.sha256, size=outcome.size),
            **tensor_records(Signature.from_dict(outcome.signature)),
            config=config,
            optimization=self.record(outcome, effective),
        )

    def cache_valid(self, mv: ModelVersion) -> bool:
        """The stored optimized files match the current cache key and their checksums (runs in a thread)."""
        from service.optimizer import OPTIMIZER_VERSION

        assert mv.metadata is not None
        optimization = mv.metadata.optimization
        expected = cache_key(mv.metadata.original.sha256, OPTIMIZER_VERSION, mv.config.graph_fields())
        if optimization is None or optimization.cache_key != expected or not optimization.variants:
            log.info("%s v%d: optimized cache is stale (settings or optimizer changed)", mv.name, mv.version)
            return False
        missing = self.to_make(mv.config) - optimization.made_for_set
        if missing:
            log.info("%s v%d: optimized without the variant(s) %s, which this server can serve", mv.name,
                     mv.version, ", ".join(sorted(missing)))
            return False
        for entry in optimization.variants.values():
            try:
                if sha256_file(self._store.file_path(mv.name, mv.version, entry.file)) != entry.sha256:
                    log.warning("%s v%d: %s does not match its checksum", mv.name, mv.version, entry.file)
                    return False
            except (OSError, ServiceError):
                return False
        return True

    async def refresh(self, mv: ModelVersion) -> None:
        """Optimize a stale version again holding its lock (see the module docstring)."""
        try:
            lock = self._store.optimize_lock_path(mv.name, mv.version)
            async with exclusive_async(lock, give_up=self._check_accepting):
                raw = await asyncio.to_thread(self._store.read_metadata, mv.name, mv.version)
                mv.metadata = VersionMetadata.parse(raw)
                if not await asyncio.to_thread(self.cache_valid, mv):
                    await self._reoptimize(mv)
        except OSError as exc:
            error = storage_error(exc)
            if error is None:
                raise
            raise type(error)(f"its optimized files are out of date and cannot be rewritten: {error.message}") from exc

    async def _reoptimize(self, mv: ModelVersion) -> None:
        assert mv.metadata is not None
        original = self._store.file_path(mv.name, mv.version, ORIGINAL)
        if await asyncio.to_thread(sha256_file, original) != mv.metadata.original.sha256:
            raise UnprocessableError("the stored original does not match its checksum")
        try:
            await self._rewrite(mv, original)
        except InsufficientStorageError as exc:  # e.g. a read-only store: the version fails, saying why
            raise type(exc)(f"its optimized files are out of date and cannot be rewritten: {exc.message}") from exc

    async def _rewrite(self, mv: ModelVersion, original: Path) -> None:
        assert mv.metadata is not None
        store = self._store
        out_dir = await asyncio.to_thread(store.new_staging_dir)
        try:
            outcome = await self.run(original, out_dir, mv.config, f"{mv.name} v{mv.version} again")
            record = await asyncio.to_thread(self.record, outcome, mv.config)
            for filename, path in outcome.files().items():
                data = await asyncio.to_thread(path.read_bytes)
                await asyncio.to_thread(store.write_artifact, mv.name, mv.version, filename, data)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        mv.metadata = fresh = mv.metadata.with_optimization(record)
        await asyncio.to_thread(store.update_metadata, mv.name, mv.version, lambda _stored: fresh.to_dict())
