"""`eopd_common.atomic_files.write_atomic`: the one atomic writer of every service (pure file I/O,
in a temporary directory)."""

from __future__ import annotations

import os
import stat

import pytest

from eopd_common import atomic_files
from eopd_common.atomic_files import write_atomic


def test_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    write_atomic(path, "new ü")
    assert path.read_text(encoding="utf-8") == "new ü"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_mode_is_what_a_plain_open_gives_under_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a", "x")
        (tmp_path / "b").write_text("x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "a").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o640


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "COMMITTED"
    path.write_text("iter000001\n")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_files.os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "iter000002\n")
    assert path.read_text() == "iter000001\n"
    assert [p.name for p in tmp_path.iterdir()] == ["COMMITTED"]


def test_a_missing_directory_is_an_error_not_a_silent_write(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "absent" / "f", "x")
