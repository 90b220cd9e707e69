"""bench/common.py's result header: which commit a result file names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402


def test_git_commit_names_the_snapshot_commit_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_COMMIT", "9268997abc")
    assert common.git_commit() == "9268997abc"


def test_git_commit_reads_head_without_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    assert common.git_commit(tmp_path) == "unknown"  # not a git checkout
    head = common.git_commit()
    assert head != "unknown" and len(head.removesuffix("-dirty")) == 40
