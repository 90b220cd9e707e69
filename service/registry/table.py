"""The model versions one server process holds, by name and number, and the lookups every request makes.

``get(name)`` routes to the newest READY version; ``get(name, n)`` to version n only while it is READY;
``find`` returns a version in any state (metadata is useful while loading). Names in messages are quoted
only when they are valid names (a hostile name is never echoed).
"""

from __future__ import annotations

from collections.abc import Iterator

from service.errors import BadRequestError, ModelNotReadyError, NotFoundError
from service.registry.acceptance import validate_model_name
from service.registry.version import ModelState, ModelVersion


def quoted(name: str) -> str:
    """A client-supplied model name for an error message: only when it is a valid (harmless) name."""
    try:
        return repr(validate_model_name(name))
    except BadRequestError:
        return "(invalid name)"


class ModelTable:
    def __init__(self) -> None:
        self._models: dict[str, dict[int, ModelVersion]] = {}

    # ------------------------------------------------------------------ changes
    def add(self, mv: ModelVersion) -> None:
        self._models.setdefault(mv.name, {})[mv.version] = mv

    def remove(self, mv: ModelVersion) -> None:
        versions = self._models.get(mv.name, {})
        if versions.get(mv.version) is mv:
            del versions[mv.version]
        if not versions:
            self._models.pop(mv.name, None)

    # ------------------------------------------------------------------ queries
    def __iter__(self) -> Iterator[ModelVersion]:
        return iter([mv for versions in self._models.values() for mv in versions.values()])

    def has(self, name: str, version: int) -> bool:
        return version in self._models.get(name, {})

    def names(self) -> list[str]:
        return sorted(name for name, versions in self._models.items() if versions)

    def ready_count(self) -> int:
        return sum(mv.state is ModelState.READY for mv in self)

    def versions(self, name: str) -> list[ModelVersion]:
        versions = self._models.get(name)
        if not versions:
            raise NotFoundError(f"model {quoted(name)} not found")
        return [versions[v] for v in sorted(versions)]

    def find(self, name: str, version: int | None = None) -> ModelVersion:
        """The addressed version in any state; without a number the newest ready one, else the newest."""
        versions = self.versions(name)
        if version is None:
            ready = [mv for mv in versions if mv.state is ModelState.READY]
            return (ready or versions)[-1]
        for mv in versions:
            if mv.version == version:
                return mv
        raise NotFoundError(f"model {quoted(name)} has no version {version}")

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        """The version that serves a request: READY, the newest one without a number."""
        if version is None:
            versions = self.versions(name)
            ready = [mv for mv in versions if mv.state is ModelState.READY]
            if not ready:
                if all(mv.state is ModelState.UNLOADED for mv in versions):
                    raise ModelNotReadyError(f"model {quoted(name)} is unloaded: load it first (repository extension)")
                raise ModelNotReadyError(f"model {quoted(name)} has no version ready to serve")
            return ready[-1]
        mv = self.find(name, version)
        if mv.state is not ModelState.READY:
            detail = f": {mv.error}" if mv.error else ""
            raise ModelNotReadyError(f"model {quoted(name)} version {version} is {mv.state.value.lower()}{detail}")
        return mv

    def ready_names(self) -> list[str]:
        """The models that have a version ready to serve, by name."""
        return [name for name in self.names()
                if any(mv.state is ModelState.READY for mv in self._models[name].values())]

    def only_model(self) -> ModelVersion:
        """The newest ready version of the one model that has one."""
        ready = self.ready_names()
        if len(ready) != 1:
            if not ready:
                raise BadRequestError("no model is loaded: upload one first")
            raise BadRequestError(f"several models are loaded; name one of: {', '.join(ready)}")
        return self.get(ready[0])
