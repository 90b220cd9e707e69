"""The registered regions of one server, as one small JSON file per region in a folder all its processes share.

With several workers a client's register call lands on one worker and its requests on any: the folder is what
they agree on. A record is created with a hard link (atomic, refused when the name is taken) and removed by
``unlink``; a process that has a region open compares the record's identity (inode and change time) with the
one it opened, so an unregistered or re-registered region is noticed at the next request that names it (one
``stat``). Names are hashed into file names, so a client's name never becomes a path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

Stamp = tuple[int, int]
"""A record file's identity: (inode, change time in ns)."""


@dataclasses.dataclass(frozen=True)
class RegionRecord:
    """A registered region as the client described it (``kind``: "system" or "cuda")."""

    name: str
    kind: str
    byte_size: int
    key: str = ""
    offset: int = 0
    device_id: int = 0
    raw_handle: str = ""
    """CUDA: the client's ``cudaIpcMemHandle_t``, base64."""

    def status(self) -> dict[str, Any]:
        """Triton's status entry: system regions show key and offset, CUDA ones the device."""
        if self.kind == "system":
            return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


class RecordFolder:
    """The folder of region records (made on first use when the server gave none: one process alone)."""

    def __init__(self, folder: Path | None = None) -> None:
        self._folder = folder

    @property
    def folder(self) -> Path:
        """The folder, made again where it went (another process's ``remove_folder``): for the writers."""
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="service-regions-"))  # mode 0700
        else:
            self._folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self._folder

    @property
    def _readable(self) -> Path:
        """The folder for the readers, not made again: every lease of every request reads a record, and a
        missing folder holds none."""
        return self._folder if self._folder is not None else self.folder

    def path(self, name: str) -> Path:
        return self._readable / (hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:40] + ".json")

    def add(self, record: RegionRecord) -> bool:
        """Record a new region; False when one of that name is registered already."""
        fd, temporary = tempfile.mkstemp(dir=self.folder, prefix=".new-")  # the folder made where it went
        try:
            with os.fdopen(fd, "w") as file:
                json.dump(dataclasses.asdict(record), file)
            os.link(temporary, self.path(record.name))
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temporary)

    def remove(self, name: str) -> bool:
        """Forget a region; False when none of that name was registered."""
        try:
            self.path(name).unlink()
            return True
        except FileNotFoundError:
            return False

    def stamp(self, name: str) -> Stamp | None:
        """The identity of the region's record, None when it is not registered."""
        try:
            stat = self.path(name).stat()
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_ctime_ns

    def read(self, name: str) -> tuple[RegionRecord, Stamp] | None:
        path = self.path(name)
        try:
            with path.open() as file:
                stamp = os.fstat(file.fileno())
                record = RegionRecord(**json.load(file))
        except FileNotFoundError:
            return None
        return record, (stamp.st_ino, stamp.st_ctime_ns)

    def all(self) -> list[RegionRecord]:
        """Every registered region, by name."""
        records = []
        for path in self._readable.glob("*.json"):
            try:
                records.append(RegionRecord(**json.loads(path.read_text())))
            except FileNotFoundError:  # unregistered meanwhile
                continue
        return sorted(records, key=lambda record: record.name)

    def remove_folder(self) -> None:
        """Forget every region (the server is stopping)."""
        if self._folder is None:
            return
        for path in self._folder.glob("*"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: another process's file appeared
            self._folder.rmdir()
