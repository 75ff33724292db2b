"""scripts/side_by_side.py: our training log beside the reference trainer's output, row by row."""
import importlib.util
import json

import pytest

from conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("side_by_side", REPO_ROOT / "scripts" / "side_by_side.py")
side_by_side = importlib.util.module_from_spec(spec)
spec.loader.exec_module(side_by_side)


def test_rows_pair_the_same_steps(tmp_path, capsys):
    out = tmp_path / "ours"
    out.mkdir()
    (out / "log.jsonl").write_text("".join(json.dumps(dict(step=s, loss=0.5 / s, psnr=s / 100, gaussians=10 * s,
                                                           time=s / 1000)) + "\n" for s in range(100, 1100, 100)))
    ref = tmp_path / "ref.txt"  # log lines with a warning between them, then the summary line (no step)
    ref.write_text("".join(json.dumps(dict(step=s, loss=0.25, psnr=30.0, gaussians=7 * s, time=s / 50)) + "\n"
                           for s in range(100, 600, 100)) + "UserWarning: something\n"
                   + json.dumps(dict(scene="x", psnr=19.4, gaussians=1)) + "\n")
    side_by_side.main([str(out), str(ref), "--every", "500"])
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["500", "1000"]
    assert "5,000" in rows[0] and "3,500" in rows[0] and "30.00" in rows[0]   # both sides at step 500
    assert "10,000" in rows[1] and rows[1].rstrip().endswith("-")             # the reference stopped at 500


def test_a_log_without_steps_is_a_clear_error(tmp_path):
    (tmp_path / "log.jsonl").write_text("")
    ref = tmp_path / "ref.txt"
    ref.write_text(json.dumps(dict(scene="x", psnr=19.4)) + "\n")
    with pytest.raises(SystemExit, match="no step lines"):
        side_by_side.main([str(tmp_path), str(ref)])
