"""RecordFolder: one JSON file per registered region, created atomically, identified by (inode, ctime)."""

from __future__ import annotations

import stat
from pathlib import Path

from service.shared_memory.records import RecordFolder, RegionRecord


def _system(name: str, key: str = "/key", byte_size: int = 16, offset: int = 0) -> RegionRecord:
    return RegionRecord(name, "system", byte_size, key=key, offset=offset)


def test_add_records_a_new_name_and_refuses_a_taken_one(tmp_path: Path) -> None:
    folder = RecordFolder(tmp_path / "regions")
    first = _system("input", key="/first")
    assert folder.add(first) is True
    assert folder.add(_system("input", key="/second", byte_size=32)) is False
    found = folder.read("input")
    assert found is not None
    assert found[0] == first  # the refused add changed nothing
    assert [p.name for p in folder.folder.iterdir()] == [folder.path("input").name]  # no temporary file left


def test_remove_forgets_the_region_and_says_whether_it_was_there(tmp_path: Path) -> None:
    folder = RecordFolder(tmp_path)
    folder.add(_system("a"))
    assert folder.remove("a") is True
    assert folder.read("a") is None
    assert folder.stamp("a") is None
    assert folder.remove("a") is False
    assert folder.remove("never") is False
    assert folder.add(_system("a")) is True  # free again


def test_stamp_matches_read_and_changes_when_the_name_is_registered_again(tmp_path: Path) -> None:
    folder = RecordFolder(tmp_path)
    folder.add(_system("a", key="/one"))
    first = folder.stamp("a")
    found = folder.read("a")
    assert first is not None and found is not None
    assert found[1] == first
    assert folder.stamp("a") == first  # stable while registered
    folder.remove("a")
    folder.add(_system("a", key="/two"))
    second = folder.stamp("a")
    assert second is not None and second != first
    again = folder.read("a")
    assert again is not None and again[0].key == "/two" and again[1] == second


def test_read_returns_every_field_and_none_for_an_unknown_name(tmp_path: Path) -> None:
    folder = RecordFolder(tmp_path)
    cuda = RegionRecord("gpu", "cuda", 4096, device_id=1, raw_handle="aGFuZGxl")
    folder.add(cuda)
    found = folder.read("gpu")
    assert found is not None and found[0] == cuda
    assert found[0].status() == {"name": "gpu", "device_id": 1, "byte_size": 4096}
    assert folder.read("other") is None


def test_all_lists_every_record_sorted_by_name(tmp_path: Path) -> None:
    folder = RecordFolder(tmp_path)
    assert folder.all() == []
    for name in ("c", "a", "b"):
        folder.add(_system(name, key=f"/{name}"))
    assert [r.name for r in folder.all()] == ["a", "b", "c"]
    assert [r.key for r in folder.all()] == ["/a", "/b", "/c"]
    folder.remove("b")
    assert [r.name for r in folder.all()] == ["a", "c"]


def test_names_never_become_paths(tmp_path: Path) -> None:
    folder = RecordFolder(tmp_path / "regions")
    name = "../../etc/passwd"
    assert folder.add(_system(name))
    path = folder.path(name)
    assert path.parent == tmp_path / "regions"
    assert path.name.endswith(".json") and len(path.name) == 45
    assert [r.name for r in folder.all()] == [name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regions"]


def test_status_of_a_system_record_shows_key_and_offset() -> None:
    record = _system("s", key="/k", byte_size=64, offset=8)
    assert record.status() == {"name": "s", "key": "/k", "offset": 8, "byte_size": 64}


def test_a_given_folder_is_made_on_first_use_with_mode_0700(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "regions"
    folder = RecordFolder(target)
    assert not target.exists()
    assert folder.folder == target
    assert target.is_dir()
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_a_private_folder_is_made_lazily_with_mode_0700(tmp_path: Path) -> None:
    folder = RecordFolder()
    assert folder._folder is None  # nothing made until used
    made = folder.folder
    try:
        assert made.is_dir()
        assert made.name.startswith("service-regions-")
        assert stat.S_IMODE(made.stat().st_mode) == 0o700
        assert folder.folder == made  # made once
    finally:
        folder.remove_folder()
    assert not made.exists()


def test_remove_folder_forgets_every_region_and_removes_the_folder(tmp_path: Path) -> None:
    folder = RecordFolder()
    folder.add(_system("a"))
    folder.add(_system("b"))
    made = folder.folder
    assert len(list(made.glob("*.json"))) == 2
    folder.remove_folder()
    assert not made.exists()


def test_remove_folder_of_a_folder_never_used_does_nothing(tmp_path: Path) -> None:
    folder = RecordFolder()
    folder.remove_folder()
    assert folder._folder is None
    given = RecordFolder(tmp_path / "never")
    given.remove_folder()
    assert not (tmp_path / "never").exists()  # not made just to be removed
