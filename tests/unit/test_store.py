"""The on-disk model store: versions, atomicity, leftovers, path safety, disk full."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time
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


def test_stored_files_are_readable_like_ordinary_files(tmp_path):
    before = os.umask(0o022)
    try:
        store = ModelStore(tmp_path)
        version = add(store, "m", b"one")
    finally:
        os.umask(before)
    for filename in (ORIGINAL, "optimized.onnx", METADATA):
        mode = stat.S_IMODE(store.file_path("m", version, filename).stat().st_mode)
        assert mode == 0o644, f"{filename}: {oct(mode)}"


def test_versions_are_numbered_and_complete(tmp_path):
    store = ModelStore(tmp_path)
    probe = store.new_staging_file()
    assert probe.parent == store.staging_dir and probe.name.startswith(store.owner)
    store.cleanup_leftovers()
    assert probe.exists(), "a live store's own staging file is not a leftover"
    probe.unlink()
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
    crashed = ModelStore(tmp_path)  # a process that dies with work in progress (its claim is let go)
    tag = f"{crashed.owner}-{'ab' * 16}"
    # a version being built when the process died, a version folder without metadata, temp files
    (model_dir / f".tmp-{tag}").mkdir()
    (model_dir / f".tmp-{tag}" / ORIGINAL).write_bytes(b"half")
    (model_dir / "7").mkdir()
    (model_dir / "7" / ORIGINAL).write_bytes(b"no metadata yet")
    (model_dir / f".metadata.json.{tag}.tmp").write_bytes(b"{")
    (model_dir / "1" / f".optimized.onnx.{tag}.tmp").write_bytes(b"partial")
    stage(crashed, b"upload in progress")
    crashed.new_staging_dir()
    (model_dir / ".tmp-0123456789abcdef0123456789abcdef").mkdir()  # no owner tag: a release before tags
    assert store.list_models() == {"m": [1]}  # incomplete versions are never visible
    # the untagged folder and the version without metadata; the crashed store's entries wait for its claim
    assert store.cleanup_leftovers() == 2
    assert sorted(p.name for p in crashed.staging_dir.iterdir())[0].startswith(crashed.owner)
    crashed.close()
    assert store.cleanup_leftovers() == 5
    assert sorted(p.name for p in model_dir.iterdir() if not p.name.startswith(".last")) == ["1"]
    remaining = sorted(p.name for p in (model_dir / "1").iterdir())
    assert remaining == sorted([ORIGINAL, METADATA, "optimized.onnx"])
    assert list(store.staging_dir.iterdir()) == []
    assert sorted(p.name for p in (tmp_path / ".owners").iterdir()) == [f"{store.owner}.lock"]
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


# ---------------------------------------------------------------------------------------------- other processes
ROOT = Path(__file__).resolve().parents[2]
_ADDER = """
import sys, time
from pathlib import Path
from service.registry.store import ModelStore
root, index, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
store = ModelStore(root)
staged = []
for i in range(count):
    path = store.new_staging_file()
    path.write_bytes(f"{index}:{i};".encode() * 5000)
    staged.append(path)
(root / f"ready-{index}").touch()
while not (root / "go").exists():
    time.sleep(0.002)
for i, path in enumerate(staged):
    store.add_version("same", path, metadata={"by": f"{index}:{i}"})
"""


def _python(script: str, *args: object, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, **kwargs)


def test_processes_adding_to_one_name_at_once_get_distinct_whole_versions(tmp_path):
    """The flock on the store's lock file allocates version numbers across processes, not only threads."""
    procs, count = 3, 6
    children = [_python(_ADDER, tmp_path, i, count) for i in range(procs)]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{i}").exists() for i in range(procs)):
        assert time.monotonic() < deadline and all(c.poll() is None for c in children), "a child failed to start"
        time.sleep(0.01)
    (tmp_path / "go").touch()
    assert [c.wait(timeout=60) for c in children] == [0] * procs
    store = ModelStore(tmp_path)
    assert store.list_models() == {"same": list(range(1, procs * count + 1))}
    seen = set()
    for version in range(1, procs * count + 1):
        by = store.read_metadata("same", version)["by"]
        assert store.file_path("same", version, ORIGINAL).read_bytes() == f"{by};".encode() * 5000
        seen.add(by)
    assert len(seen) == procs * count


_STAGER = """
import sys, time
from pathlib import Path
from service.registry.store import ModelStore
store = ModelStore(Path(sys.argv[1]))
path = store.new_staging_file()
path.write_bytes(b"an upload still streaming in")
building = store.new_staging_dir()
print(path, building, flush=True)
time.sleep(600)
"""


def test_a_cleanup_leaves_a_live_process_work_alone_and_removes_it_once_that_process_is_killed(tmp_path):
    child = _python(_STAGER, tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        staged, building = map(Path, child.stdout.readline().split())
        store = ModelStore(tmp_path)  # a replica starting while the other one uploads
        assert store.cleanup_leftovers() == 0
        assert staged.read_bytes() == b"an upload still streaming in" and building.is_dir()
        child.kill()  # kill -9: nothing runs in the child
        child.wait(timeout=10)
        assert store.cleanup_leftovers() == 2
        assert not staged.exists() and not building.exists()
        assert [p.name for p in (tmp_path / ".owners").iterdir()] == [f"{store.owner}.lock"]
    finally:
        child.kill()
        child.wait(timeout=10)


def test_tuner_faults_are_kept_store_wide_once_each(tmp_path):
    """Faults are kept in the store's root (every process sharing the store reads them), one per GPU model,
    ORT version, graph and configuration; a fault seen again replaces the older entry."""
    store = ModelStore(tmp_path)
    assert store.tuner_faults() == []
    fault = {"device": "GPU X", "ort_version": "1.31.1", "graph_sha256": "a" * 64, "config": "plain/nchw/fp32",
             "variant": "plain", "error": "CUDA failure 715", "seen": "2026-12-02T08:00:00Z"}
    other = {**fault, "config": "plain/nchw/fp16"}
    store.add_tuner_faults([fault])
    store.add_tuner_faults([other, {**fault, "seen": "2026-12-02T09:00:00Z"}])
    assert store.tuner_faults() == [other, {**fault, "seen": "2026-12-02T09:00:00Z"}]
    assert ModelStore(tmp_path).tuner_faults() == store.tuner_faults()  # another process sharing the store
    assert store.list_models() == {} and store.is_fresh()  # the file is no model
    (tmp_path / ".tuner-faults.json").write_text("{not json")
    assert store.tuner_faults() == []  # an unreadable file costs the knowledge, never the load
