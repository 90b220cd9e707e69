"""The file locks the model store shares between processes (several workers, replicas on other hosts).

**Owner claims.** Every file or folder a store creates while it works (a staging file, a version being built
or deleted, a temp file of an atomic write) carries its owner's id in its name, and the owner holds an
exclusive ``flock`` on ``.owners/<owner>.lock`` for as long as it lives. The kernel, or the lock server of a
shared filesystem, lets go of that lock when the process ends, however it ends (kill -9, the OOM killer; a
lost NFS client once its lease runs out). So a lock that can be taken means exactly "its owner is gone", and
a cleanup removes another process' entries only then: a replica that starts never touches an upload another
live replica is streaming or optimizing. Why locks and not an age bound: an upload or an optimization may
last longer than any bound (a slow link, ``optimizer_timeout_s`` up to an hour, a stopped process), and a dead
process' files would stay for the whole bound; the store needs working locks for its version numbers anyway.

An owner creates its lock file, locks it, then checks that the path still names the file it locked (a
cleanup may have taken and unlinked a lock file in the instant between create and lock); only then does it
create entries. So an entry whose owner's lock file is free or missing belongs to a process that is gone.

**Exclusive holds** (``exclusive_async``): one process at a time prepares a fresh store or optimizes a stale
version again. It polls, so a shutdown is never stuck behind another replica's long hold.

Every lock is taken on a file opened for writing: NFS clients map ``flock`` to POSIX write locks, which need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

OWNER_RE = re.compile(r"[0-9a-f]{16}", re.ASCII)
POLL_S = 0.1
_CLAIM_ATTEMPTS = 8


def try_lock(fd: int) -> bool:
    """An exclusive flock on ``fd`` without waiting: False when another open file holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _names_file(path: Path, fd: int) -> bool:
    try:
        seen, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (seen.st_dev, seen.st_ino) == (held.st_dev, held.st_ino)


class Claim:
    """This process' (this store object's) owner id, locked in ``folder`` until ``close``."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(exist_ok=True)
        for _ in range(_CLAIM_ATTEMPTS):
            owner = uuid.uuid4().hex[:16]
            path = folder / f"{owner}.lock"
            # read-only: an fd open for writing would keep an admin from remounting the store read-only
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o600)
            if try_lock(fd) and _names_file(path, fd):
                self.owner, self.path, self._fd = owner, path, fd
                return
            os.close(fd)
        raise OSError(f"could not claim an owner lock in {folder.name} after {_CLAIM_ATTEMPTS} attempts")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        """Give the claim up (the lock file goes first, while still locked; on a store that refuses the unlink
        it stays, unlocked, and a later cleanup reaps it)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._fd is not None:
                os.close(self._fd)


class OwnerCheck:
    """Which owners are gone, for one cleanup pass: the lock of each gone owner is held until the pass ends,
    then its lock file is removed. Owners are looked at lazily, as their entries are met."""

    def __init__(self, folder: Path, me: str) -> None:
        self.folder = folder
        self.me = me
        self._gone: dict[str, int | None] = {}  # owner -> the fd of its lock we hold (None: no lock file)
        self._alive: set[str] = {me}

    def gone(self, owner: str) -> bool:
        if owner in self._alive:
            return False
        if owner in self._gone:
            return True
        try:
            fd = os.open(self.folder / f"{owner}.lock", os.O_RDONLY)
        except FileNotFoundError:
            self._gone[owner] = None
            return True
        except OSError:  # not ours to open (another user): it cannot be told gone, so it stays
            self._alive.add(owner)
            return False
        if try_lock(fd):
            self._gone[owner] = fd
            return True
        os.close(fd)
        self._alive.add(owner)
        return False

    def reap_lock_files(self) -> int:
        """Take the locks of gone owners that left no entries too (their files go at ``close``). Returns how
        many owners this pass found gone."""
        for entry in self.folder.iterdir():
            owner = entry.name.removesuffix(".lock")
            if entry.name.endswith(".lock") and OWNER_RE.fullmatch(owner):
                self.gone(owner)
        return len(self._gone)

    def close(self) -> None:
        for owner, fd in self._gone.items():
            if fd is not None:
                (self.folder / f"{owner}.lock").unlink(missing_ok=True)
                os.close(fd)
        self._gone.clear()


@contextlib.asynccontextmanager
async def exclusive_async(path: Path, *, give_up: Callable[[], None] | None = None) -> AsyncIterator[None]:
    """Hold an exclusive lock on ``path`` from the event loop, polling every ``POLL_S``; ``give_up`` is called
    before each new try and may raise (e.g. the server is stopping)."""
    fd = await asyncio.to_thread(os.open, path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while not try_lock(fd):
            if give_up is not None:
                give_up()
            await asyncio.sleep(POLL_S)
        yield
    finally:
        os.close(fd)
