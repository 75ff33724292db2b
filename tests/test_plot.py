"""cli/plot.py: PNG curves from a synthetic log.jsonl, a resumed run's repeats resolved, a missing
matplotlib named."""
import importlib.util
import json
import sys

import pytest

import cli
from cli.plot import read_log, series

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def write_run(folder, resumed=True):
    """A log of steps 100..1000; killed after 700 and resumed from the snapshot at 500 (steps 600 and
    700 logged twice); a line cut by the kill; the test PSNR of the end in metrics.json."""
    lines = []
    for step in range(100, 800, 100):
        lines.append(json.dumps({"step": step, "loss": 1.0 / step, "psnr": 10 + step / 100, "gaussians": step * 10,
                                 "time": step * 0.01}))
    lines.append('{"step": 800, "loss": 0.1')  # cut
    for step in range(600, 1100, 100):
        lines.append(json.dumps({"step": step, "loss": 0.5 / step, "psnr": 11 + step / 100, "gaussians": step * 20,
                                 "gaussians_total": step * 40, "time": 5 + step * 0.02, "refined": 3}))
    (folder / "log.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "metrics.json").write_text(json.dumps({"psnr": 25.5, "iterations": 1000, "views": []}))


def test_read_log_keeps_the_resumed_runs_records(tmp_path):
    write_run(tmp_path)
    records, bad = read_log(tmp_path / "log.jsonl")
    assert bad == 1
    assert [r["step"] for r in records] == list(range(100, 1100, 100))
    assert records[5]["psnr"] == 17 and records[4]["psnr"] == 15     # 600: the resumed run's


def test_series_of_each_curve(tmp_path):
    write_run(tmp_path)
    records, _ = read_log(tmp_path / "log.jsonl")
    data = series(records, json.loads((tmp_path / "metrics.json").read_text()))
    steps, ms = data["step_seconds"]
    assert steps == list(range(200, 1100, 100)) and ms[0] == pytest.approx(10.0) and ms[-1] == pytest.approx(20.0)
    assert data["gaussians"][1][-1] == 40000                           # the whole model's under MPI
    assert data["psnr/test"] == ([1000], [25.5])
    assert len(data["loss"][0]) == len(data["psnr/train"][0]) == 10


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed (the plot extra)")
def test_plot_writes_a_png_per_curve(tmp_path, capsys):
    write_run(tmp_path)
    assert cli.main(["plot", "--model", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["gaussians.png", "loss.png", "psnr.png", "step_time.png"]
    from PIL import Image
    assert all(Image.open(tmp_path / "plots" / p).size == (700, 400) for p in pngs)
    assert "(1 unreadable log lines skipped)" in capsys.readouterr().out
    assert cli.main(["plot", "--model", str(tmp_path), "--out", str(tmp_path / "elsewhere")]) == 0
    assert len(list((tmp_path / "elsewhere").glob("*.png"))) == 4


def test_plot_names_what_is_missing(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=f"no training log at {tmp_path}/log.jsonl"):
        cli.main(["plot", "--model", str(tmp_path)])
    write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"plot needs matplotlib: pip install -e '\.\[plot\]'"):
        cli.main(["plot", "--model", str(tmp_path)])


def test_compared_curve_reads_a_run_folder_or_the_references_lines(tmp_path):
    """--compare draws another run's test PSNR: a training output folder's log, or the reference trainer's
    JSON lines (its summary line, which has no step, skipped); a log without test PSNR is one clear error."""
    from cli.plot import compared_curve
    run = tmp_path / "ours"
    run.mkdir()
    (run / "log.jsonl").write_text("\n".join(json.dumps({"step": s, "loss": 0.1, "psnr": 20, "test_psnr": 20 + s / 1000})
                                             for s in (1000, 2000)) + "\n")
    ref = tmp_path / "helmet_reference_30k.txt"
    ref.write_text('{"step": 100, "loss": 0.2, "psnr": 18}\n{"step": 1000, "loss": 0.1, "psnr": 19, "test_psnr": 21.5}\n'
                   '{"scene": "helmet", "psnr": 21.5, "train_s": 3.0}\n')
    assert compared_curve(run) == ("ours", ([1000, 2000], [21.0, 22.0]))
    assert compared_curve(ref) == ("helmet_reference_30k", ([1000], [21.5]))
    plain = tmp_path / "plain"
    plain.mkdir()
    write_run(plain)
    with pytest.raises(SystemExit, match="no test PSNR"):
        compared_curve(tmp_path / "plain")
    with pytest.raises(SystemExit, match="no training log"):
        compared_curve(tmp_path / "missing")
