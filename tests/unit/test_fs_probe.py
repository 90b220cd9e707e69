"""The startup check of the model store's filesystem: locks that exclude another process, O_EXCL, rename."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from service.registry import fs_probe
from service.registry.fs_probe import StoreFilesystemError, check_store_filesystem
from service.server import main
from service.settings import ServiceSettings


def test_a_local_filesystem_passes_and_the_probe_leaves_nothing(tmp_path):
    check_store_filesystem(tmp_path / "models")
    assert list((tmp_path / "models" / fs_probe.PROBE_DIR).iterdir()) == []


def test_locks_that_do_not_exclude_are_refused(tmp_path, monkeypatch):
    """A filesystem whose locks do nothing: this process' lock is a no-op, so the child's is granted."""
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: None)
    with pytest.raises(StoreFilesystemError, match="file locks do not exclude other processes") as info:
        check_store_filesystem(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_a_filesystem_without_locks_is_refused(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))  # NFSv3 without lockd

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(StoreFilesystemError, match="file locks are not available"):
        check_store_filesystem(tmp_path)


def test_o_excl_that_creates_twice_is_refused(tmp_path, monkeypatch):
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *mode: real_open(path, flags & ~os.O_EXCL, *mode))
    with pytest.raises(StoreFilesystemError, match="O_EXCL creates an existing file again"):
        check_store_filesystem(tmp_path)


def test_serve_refuses_to_start_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: None)
    monkeypatch.setattr(main, "serve_single", lambda settings: pytest.fail("the server started"))
    assert main.serve(ServiceSettings(model_dir=tmp_path, demo_model=False)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: model store ") and err.count("\n") == 1 and "docs/scaling.md" in err
