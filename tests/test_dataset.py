"""data/dataset.py: format detection and its errors; the package: importing it
from the repository root, and its modules' layering."""
import ast
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from data import DataError, load_dataset


def test_error_undetectable_folder(tmp_path):
    (tmp_path / "stuff").mkdir()
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "stuff")
    msg = str(err.value)
    assert "stuff" in msg and "sparse" in msg and "transforms_train.json" in msg and "transforms.json" in msg
    with pytest.raises(DataError, match="nowhere"):
        load_dataset(tmp_path / "nowhere")
    with pytest.raises(DataError, match="fmt|format"):
        load_dataset(tmp_path / "stuff", fmt="llff")
    assert issubclass(DataError, ValueError)


def test_import_from_repo_root():
    proc = subprocess.run([sys.executable, "-c", "import data; print(data.load_dataset.__name__)"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "load_dataset"



def test_modules_import_only_those_below_them():
    order = ["dataset", "colmap", "nerf", "images", "ply", "atomic", "scene"]   # as data/__init__.py lists them
    files = sorted(p.stem for p in (REPO_ROOT / "data").glob("*.py") if p.stem != "__init__")
    assert sorted(order) == files
    for i, module in enumerate(order):
        tree = ast.parse((REPO_ROOT / "data" / f"{module}.py").read_text())
        imported = {alias.name if node.module is None else node.module.split(".")[0]
                    for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
                    for alias in node.names}
        assert imported <= set(order[i + 1:]), (module, imported - set(order[i + 1:]))
