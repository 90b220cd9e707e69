"""Does the model store's filesystem give what the store relies on? Checked once before a server starts.

The store (``store``, ``locks``) needs, from every process and host that mounts it:
* ``flock`` locks that exclude each other across processes, and across hosts where replicas share the
  folder (Linux emulates ``flock`` with POSIX byte-range locks on NFS, so NFSv3 needs lockd/NLM, NFSv4 has
  them built in; CephFS and EFS (NFSv4.1) have them; some SMB and FUSE mounts keep locks local to one host
  or ignore them);
* ``O_CREAT | O_EXCL`` that refuses an existing name;
* ``rename`` that replaces a file, and moves a folder, in one step.

The probe takes an exclusive lock on a probe file and asks a child process for a second one, which must be
refused; it creates a name twice with ``O_EXCL`` (the second must fail) and renames a file over another and a
folder to a new name. What it cannot see: whether locks reach *other hosts* (a mount whose locks are local to
one host passes here); docs/scaling.md lists the filesystems known to do it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

PROBE_DIR = ".owners"
CHILD_TIMEOUT_S = 30.0
_CHILD = """
import errno, fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    print("refused")
except OSError as exc:
    print("error", errno.errorcode.get(exc.errno, exc.errno))
else:
    print("granted")
"""
_SEE = "the store needs POSIX file locks shared by every process using it (docs/scaling.md)"


class StoreFilesystemError(RuntimeError):
    """The store's filesystem lacks something the store needs; the message is one line naming it."""


def check_store_filesystem(root: Path) -> None:
    """Raise StoreFilesystemError unless ``root``'s filesystem has exclusive locks, O_EXCL and rename."""
    root = Path(root)
    try:
        folder = root / PROBE_DIR
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreFilesystemError(f"model store {root}: cannot create {PROBE_DIR}: {exc.strerror or exc}") from None
    base = folder / f"probe-{uuid.uuid4().hex}"
    try:
        _check_exclusive_create(base)
        _check_lock(root, base)
        _check_rename(base)
    finally:
        for path in (base, base.with_suffix(".new")):
            with contextlib.suppress(OSError):
                path.unlink()
        shutil.rmtree(base.with_suffix(".d"), ignore_errors=True)
        shutil.rmtree(base.with_suffix(".moved"), ignore_errors=True)


def _check_exclusive_create(path: Path) -> None:
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return
    raise StoreFilesystemError(f"model store {path.parents[1]}: O_EXCL creates an existing file again; {_SEE}")


def _check_lock(root: Path, path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise StoreFilesystemError(
                f"model store {root}: file locks are not available ({exc.strerror or exc}); {_SEE}"
            ) from None
        answer = _second_lock_from_a_child(path)
    finally:
        os.close(fd)
    if answer == "granted":
        raise StoreFilesystemError(f"model store {root}: file locks do not exclude other processes; {_SEE}")
    if answer != "refused":
        raise StoreFilesystemError(f"model store {root}: a second process could not test the lock ({answer}); {_SEE}")


def _second_lock_from_a_child(path: Path) -> str:
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD, str(path)], capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return type(exc).__name__
    return done.stdout.strip() or f"exit status {done.returncode}"


def _check_rename(base: Path) -> None:
    new = base.with_suffix(".new")
    new.write_bytes(b"new")
    folder, moved = base.with_suffix(".d"), base.with_suffix(".moved")
    try:
        os.replace(new, base)
        folder.mkdir()
        (folder / "inside").write_bytes(b"x")
        os.rename(folder, moved)
    except OSError as exc:
        raise StoreFilesystemError(f"model store {base.parents[1]}: rename failed ({exc.strerror or exc})") from None
    if base.read_bytes() != b"new" or new.exists() or folder.exists() or not (moved / "inside").is_file():
        raise StoreFilesystemError(f"model store {base.parents[1]}: rename does not replace or move in one step")
