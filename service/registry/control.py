"""What the store's helpers need of a server process's model manager, as narrow interfaces.

The repository extension (``repository``), the store follower (``sync``) and the import folder (``importer``)
act on the process's versions through these Protocols, never through ``manager.ModelManager`` itself, which
builds them and satisfies all three: the imports run one way, ``manager -> repository, sync, importer ->
control``, with no circle, not even one for type checking.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

from service.model_config import ModelConfig
from service.registry.store import ModelStore
from service.registry.table import ModelTable
from service.registry.version import ModelVersion


class StoredVersions(Protocol):
    """Serving and unserving the stored versions of one process (``repository``: unload and load)."""

    @property
    def store(self) -> ModelStore: ...

    @property
    def table(self) -> ModelTable: ...

    @property
    def store_lock(self) -> asyncio.Lock:
        """Held while versions appear or go, so that a sync never sees one half-way."""
        ...

    async def load_stored(self, name: str, version: int) -> None:
        """Load a stored version (FAILED, logged, when it cannot be)."""
        ...

    async def unload(self, mv: ModelVersion, *, keep_entry: bool = False) -> None:
        """Stop serving ``mv`` once its in-flight requests finish; ``keep_entry``: list it as UNLOADED."""
        ...

    def report_loaded(self) -> None:
        """Publish how many versions are served (a metric)."""
        ...


class FollowedVersions(StoredVersions, Protocol):
    """What following a store other processes change needs besides (``sync``)."""

    @property
    def stopping(self) -> bool: ...

    async def register_unloaded(self, name: str, version: int) -> None:
        """List a stored version of an unloaded model as UNLOADED, without loading it."""
        ...


class Uploads(Protocol):
    """Uploading a file as a new version (``importer``: the import folder)."""

    @property
    def store(self) -> ModelStore: ...

    def check_accepting(self) -> None:
        """ShuttingDownError once the process stops."""
        ...

    def new_staging_file(self) -> Path: ...

    async def upload(self, name: str, staged: Path, config: ModelConfig) -> ModelVersion:
        """Validate, optimize, verify, store and load ``staged`` (which it owns) as the next version."""
        ...
