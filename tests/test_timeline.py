"""engine.tools.timeline's summary of a CUPTI trace (a made-up trace: the recording needs a GPU and torch)."""
import pytest

from engine.tools.timeline import STEP_MARK, report_lines, summarize


def _x(name, cat, ts, dur, corr=None):
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace():
    """Three steps of 100 us of host time each; step s launches two kernels (10 us each, the second
    overlapping the first by 5 us) and a copy, then waits once for 20 us."""
    events = []
    for s in range(3):
        t0 = 1000 * s
        events.append(_x(STEP_MARK, "user_annotation", t0, 100))
        for j in range(3):
            corr = 10 * s + j
            events.append(_x("cuLaunchKernel" if j < 2 else "cudaMemcpyAsync", "cuda_driver", t0 + 10 * j, 5, corr))
        events.append(_x("kern_a", "kernel", t0 + 200, 10, 10 * s))
        events.append(_x("kern_b", "kernel", t0 + 205, 10, 10 * s + 1))
        events.append(_x("copy", "gpu_memcpy", t0 + 300, 4, 10 * s + 2))
        events.append(_x("cudaStreamSynchronize", "cuda_runtime", t0 + 50, 20))
    events.append(_x("stray", "kernel", 5000, 50, 999))  # launched outside every step: not counted
    return events


def test_summary_of_a_trace():
    s = summarize(_trace())
    assert s["steps"] == 2  # the last step has no next step to end its device span
    assert s["host_ms"] == pytest.approx(0.1)
    assert s["device_span_ms"] == pytest.approx(1.0)
    assert s["device_busy_ms"] == pytest.approx(0.019)  # 15 us of the overlapping kernels + 4 us of copy
    assert s["device_idle_ms"] == pytest.approx(1.0 - 0.019)
    assert s["kernels"] == 2 and s["waits"] == 1 and s["wait_ms"] == pytest.approx(0.02)
    assert s["top_kernels"] == [("kern_a", pytest.approx(0.01), 1.0), ("kern_b", pytest.approx(0.01), 1.0)]
    assert "2 kernels" in report_lines(s)[0] and "kern_a" in report_lines(s)[2]


def test_kernel_names_are_made_readable():
    """Numba's mangled kernels, CUB's templates and CuPy's elementwise kernels, as a report lists them."""
    from engine.tools.timeline import kernel_name
    assert kernel_name("numbasplat::cuda::raster::_project_kernel[abi:v1][abi:cw51cXT](Array<float, 2>)") == \
        "raster._project_kernel"
    assert kernel_name("void cub::CUB_300102_SM_750_800_900::detail::radix_sort::DeviceRadixSortOnesweepKernel"
                       "<cub::detail::radix::policy_hub<unsigned short>, false>(int*)") == \
        "cub::detail::radix_sort::DeviceRadixSortOnesweepKernel"
    assert kernel_name("cupy_take") == "cupy_take"


def test_a_trace_without_steps_is_an_error():
    with pytest.raises(ValueError, match="no steps"):
        summarize([_x("kern_a", "kernel", 0, 10, 1)])


class _Fake:
    """Stands in for torch, its profiler and record_function: logs what the hook opens and closes."""
    def __init__(self, log, name="profiler"):
        self.log, self.name = log, name
        self.cuda = self

    def synchronize(self):
        pass

    def __call__(self, name):
        return _Fake(self.log, name)

    def __enter__(self):
        self.log.append(("enter", self.name, self.step()))

    def __exit__(self, *exc):
        self.log.append(("exit", self.name, self.step()))

    def step(self):
        return _Fake.trainer.step


def test_training_timeline_hook_marks_the_steps_after_start(monkeypatch):
    from types import SimpleNamespace

    import engine.tools.timeline as tl
    log, lines = [], []
    fake = _Fake(log)
    _Fake.trainer = trainer = SimpleNamespace(step=0)
    monkeypatch.setattr(tl, "_profiler", lambda: (fake, fake, fake))
    monkeypatch.setattr(tl, "check_available", lambda backend=None: None)
    monkeypatch.setattr(tl, "_events", lambda prof, keep: _trace())
    hook = tl.TrainingTimeline(2, 3, log=lines.append)
    for trainer.step in range(1, 9):
        hook(trainer)
    assert log == [("enter", "profiler", 2), ("enter", STEP_MARK, 2), ("exit", STEP_MARK, 3),
                   ("enter", STEP_MARK, 3), ("exit", STEP_MARK, 4), ("enter", STEP_MARK, 4),
                   ("exit", STEP_MARK, 5), ("exit", "profiler", 5)]
    assert lines and lines[0].startswith("timeline (CUPTI, median of 2 unsynced steps)")
    with pytest.raises(ValueError, match="STEPS >= 2"):
        tl.TrainingTimeline(0, 1)


def test_timeline_option_is_checked():
    from cli.train import train_parser
    assert train_parser().parse_args(["--timeline", "100:20"]).timeline == (100, 20)
    for bad in ("100", "a:b", "-1:5", "10:1"):
        with pytest.raises(Exception, match="START"):
            train_parser().parse_args([f"--timeline={bad}"])


def test_timeline_without_a_gpu_is_one_clear_error(tmp_path):
    """On the CPU backend ``--timeline`` stops before anything loads, naming the backend."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "NUMBASPLAT_BACKEND": "cpu"}
    r = subprocess.run([sys.executable, str(root / "run.py"), "train", "--data", str(tmp_path / "none"), "--out",
                        str(tmp_path / "out"), "--timeline", "1:2"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == "error: --timeline records a GPU's steps; this run's backend is cpu"
    assert not (tmp_path / "out").exists()


def test_host_profile_hook_profiles_only_its_steps():
    """``--host-profile 2:3`` profiles the steps after step 2 to step 5 and reports the Python run
    there, per step: a function called once a step inside the window shows 1.0 calls a step, one
    called only outside it does not show."""
    from types import SimpleNamespace

    import engine.tools.timeline as tl

    def inside_the_window():
        return sum(range(2000))

    def outside_the_window():
        return sum(range(2000))

    lines = []
    hook = tl.HostProfile(2, 3, log=lines.append)
    trainer = SimpleNamespace(step=0)
    for trainer.step in range(1, 9):
        (inside_the_window if 2 < trainer.step <= 5 else outside_the_window)()  # steps 3, 4, 5
        hook(trainer)
    assert lines[0].startswith("host profile (3 steps):")
    row = next(x for x in lines if "inside_the_window" in x)
    assert row.split()[1] == "1.0"
    assert not any("outside_the_window" in x for x in lines)
    ranked = next(i for i, x in enumerate(lines) if "by cumulative time" in x)
    cumulative = [float(x.split()[2]) for x in lines[ranked + 1:]]
    assert cumulative == sorted(cumulative, reverse=True) and len(cumulative) > 1
    with pytest.raises(ValueError, match="STEPS >= 2"):
        tl.HostProfile(0, 1)
    from cli.train import train_parser
    assert train_parser().parse_args(["--host-profile", "100:20"]).host_profile == (100, 20)
