"""The on-disk model store: versions, atomicity, leftovers, path safety, disk full."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from service.errors import BadRequestError, InsufficientStorageError, NotFoundError
from service.registry.store import METADATA, ORIGINAL, ModelStore, cache_key, sha256_file


def stage(store: ModelStore, content: bytes) -> Path:
    path = store.new_staging_file()
    path.write_bytes(content)
    return path


def add(store: ModelStore, name: str, content: bytes, **meta) -> int:
    optimized = stage(store, b"optimized:" + content)
    return store.add_version(name, stage(store, content), files={"optimized.onnx": optimized}, metadata=meta)


def test_versions_are_numbered_and_complete(tmp_path):
    store = ModelStore(tmp_path)
    assert store.new_staging_file().parent == store.staging_dir
    store.cleanup_leftovers()
    assert add(store, "m", b"one", note="first") == 1
    assert add(store, "m", b"two") == 2
    assert add(store, "other", b"x") == 1
    assert store.list_models() == {"m": [1, 2], "other": [1]}
    assert store.file_path("m", 1, ORIGINAL).read_bytes() == b"one"
    assert store.file_path("m", 2, "optimized.onnx").read_bytes() == b"optimized:two"
    meta = store.read_metadata("m", 1)
    assert meta == {"name": "m", "version": 1, "note": "first"}
    assert list(store.staging_dir.iterdir()) == []  # staged files were moved in


def test_concurrent_adds_get_distinct_versions_and_never_mix_files(tmp_path):
    store = ModelStore(tmp_path)
    contents = [os.urandom(200_000) + bytes([i]) for i in range(12)]
    versions: dict[int, int] = {}
    barrier = threading.Barrier(len(contents))

    def worker(i: int) -> None:
        staged = stage(store, contents[i])
        barrier.wait()
        versions[i] = store.add_version("same", staged, metadata={"i": i})

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(contents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(versions.values()) == list(range(1, len(contents) + 1))
    for i, version in versions.items():
        assert store.file_path("same", version, ORIGINAL).read_bytes() == contents[i]
        assert store.read_metadata("same", version)["i"] == i


def test_two_store_objects_on_one_folder_do_not_collide(tmp_path):
    a, b = ModelStore(tmp_path), ModelStore(tmp_path)
    assert [add(a, "m", b"1"), add(b, "m", b"2"), add(a, "m", b"3")] == [1, 2, 3]


def test_deleted_versions_disappear_and_numbers_are_not_reused(tmp_path):
    store = ModelStore(tmp_path)
    add(store, "m", b"1")
    add(store, "m", b"2")
    assert not store.is_fresh()
    store.delete_version("m", 2)
    assert store.list_models() == {"m": [1]}
    with pytest.raises(NotFoundError):
        store.read_metadata("m", 2)
    with pytest.raises(NotFoundError):
        store.delete_version("m", 2)
    assert add(store, "m", b"3") == 3
    store.delete_version("m", 1)
    store.delete_version("m", 3)
    assert store.list_models() == {} and not store.is_fresh()
    fresh = ModelStore(tmp_path / "new")
    (fresh.root / "crashed-before-its-first-version" / ".tmp-abc").mkdir(parents=True)
    assert fresh.is_fresh()


def test_leftovers_of_a_crash_are_invisible_and_cleaned(tmp_path):
    store = ModelStore(tmp_path)
    add(store, "m", b"good")
    model_dir = tmp_path / "m"
    # a version being built when the process died, a version folder without metadata, temp files
    (model_dir / ".tmp-deadbeef").mkdir()
    (model_dir / ".tmp-deadbeef" / ORIGINAL).write_bytes(b"half")
    (model_dir / "7").mkdir()
    (model_dir / "7" / ORIGINAL).write_bytes(b"no metadata yet")
    (model_dir / ".metadata.json.abc.tmp").write_bytes(b"{")
    (model_dir / "1" / ".optimized.onnx.abc.tmp").write_bytes(b"partial")
    stage(store, b"upload in progress")
    store.new_staging_dir()
    assert store.list_models() == {"m": [1]}  # incomplete versions are never visible
    assert store.cleanup_leftovers() == 6
    assert sorted(p.name for p in model_dir.iterdir() if not p.name.startswith(".last")) == ["1"]
    remaining = sorted(p.name for p in (model_dir / "1").iterdir())
    assert remaining == sorted([ORIGINAL, METADATA, "optimized.onnx"])
    assert list(store.staging_dir.iterdir()) == []
    assert store.cleanup_leftovers() == 0


def test_cleanup_never_follows_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    store = ModelStore(tmp_path / "store")
    add(store, "m", b"x")
    (store.root / "m" / ".tmp-link").symlink_to(outside, target_is_directory=True)
    (store.staging_dir / "link").symlink_to(outside, target_is_directory=True)
    store.cleanup_leftovers()
    assert (outside / "precious").read_text() == "keep"


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "/abs", "n\x00ul", "caf\u00e9", ".staging"])
def test_unsafe_names_never_become_paths(tmp_path, name):
    store = ModelStore(tmp_path / "store")
    with pytest.raises(BadRequestError):
        store.add_version(name, stage(store, b"x"))
    with pytest.raises(BadRequestError):
        store.read_metadata(name, 1)
    assert not (tmp_path / "escape").exists()


def test_a_symlinked_model_folder_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = ModelStore(tmp_path / "store")
    (store.root / "evil").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BadRequestError):
        store.add_version("evil", stage(store, b"x"))
    assert list(outside.iterdir()) == []
    assert store.list_models() == {}


@pytest.mark.parametrize("version", [0, -1, True, "1", 1.0])
def test_versions_must_be_positive_ints(tmp_path, version):
    store = ModelStore(tmp_path)
    add(store, "m", b"x")
    with pytest.raises(NotFoundError):
        store.read_metadata("m", version)


def test_write_artifact_replaces_atomically_and_refuses_odd_names(tmp_path):
    store = ModelStore(tmp_path)
    add(store, "m", b"x")
    store.write_artifact("m", 1, "optimized.onnx", b"new")
    store.write_artifact("m", 1, "optimized-plain.onnx", b"plain")
    assert store.file_path("m", 1, "optimized.onnx").read_bytes() == b"new"
    assert store.file_path("m", 1, "optimized-plain.onnx").read_bytes() == b"plain"
    for bad in ("../x.onnx", "original.onnx", "metadata.json", "x.sh", ".hidden.onnx", "a/b.onnx"):
        with pytest.raises(BadRequestError):
            store.write_artifact("m", 1, bad, b"evil")
    store.write_metadata("m", 1, {"k": "v", "version": 99})
    assert store.read_metadata("m", 1) == {"k": "v", "name": "m", "version": 1}


def test_disk_full_gives_507_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    store = ModelStore(tmp_path)
    add(store, "m", b"v1")
    staged = stage(store, b"v2")
    optimized = stage(store, b"opt2")

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(InsufficientStorageError) as info:
        store.add_version("m", staged, files={"optimized.onnx": optimized}, metadata={})
    assert info.value.status == 507
    with pytest.raises(InsufficientStorageError):
        store.write_artifact("m", 1, "optimized.onnx", b"would replace")
    monkeypatch.undo()
    assert store.list_models() == {"m": [1]}
    assert store.file_path("m", 1, "optimized.onnx").read_bytes() == b"optimized:v1"
    leftovers = [p.name for p in (tmp_path / "m").rglob("*") if ".tmp" in p.name]
    assert leftovers == []
    assert add(store, "m", b"v2 again") == 2  # the store works once space is back


def test_cache_key_and_sha256(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    assert sha256_file(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    base = cache_key("aa", "1", {"fused_conv": True, "verify": True})
    assert base == cache_key("aa", "1", {"verify": True, "fused_conv": True})
    assert base != cache_key("ab", "1", {"fused_conv": True, "verify": True})
    assert base != cache_key("aa", "2", {"fused_conv": True, "verify": True})
    assert base != cache_key("aa", "1", {"fused_conv": False, "verify": True})
