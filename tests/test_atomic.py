"""data/atomic.py: a write creates its missing folders, and a failure names the file asked for, not
the temporary one beside it."""
import os

import pytest

from data.atomic import atomic_path


def test_a_missing_folder_is_created(tmp_path):
    path = tmp_path / "new" / "deeper" / "file.txt"
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write("ok")
    assert path.read_text() == "ok" and os.listdir(path.parent) == ["file.txt"]


def test_a_failed_write_names_the_file_not_the_temporary_one(tmp_path):
    path = tmp_path / "scene.ply"
    with pytest.raises(PermissionError) as e:
        with atomic_path(path) as tmp:
            raise PermissionError(13, "Permission denied", tmp)
    assert str(e.value) == f"cannot write {path}: Permission denied" and ".tmp-" not in str(e.value)
    with pytest.raises(OSError) as e:  # a library's message that quotes the temporary file
        with atomic_path(path) as tmp:
            raise OSError(f"Unable to create file (name = '{tmp}', errno = 5)")
    assert str(e.value) == f"cannot write {path}: Unable to create file (name = '{path}', errno = 5)"
    assert os.listdir(tmp_path) == []


def test_a_folder_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(OSError, match=f"cannot write {tmp_path}/taken/x.ply: cannot create the folder "
                                      f"{tmp_path}/taken"):
        with atomic_path(tmp_path / "taken" / "x.ply"):
            pass


def test_other_errors_pass_unchanged(tmp_path):
    with pytest.raises(ValueError, match="bad input"):
        with atomic_path(tmp_path / "x"):
            raise ValueError("bad input")
    assert os.listdir(tmp_path) == []
