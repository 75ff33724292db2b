"""A device timeline of a few training steps: where a step's time goes between the host and the GPU.

Nsight Systems is not on every GPU machine; CUPTI is, through ``torch.profiler`` (an optional
dependency, used by this measurement alone).  CUPTI records every kernel, copy and memset of the
process, whichever library launched it (Numba, CuPy), and the host's CUDA API calls.  From those
``summarize`` gives, per step: the kernels launched, the device's busy time (the union of its
kernels' and copies' intervals) and idle time, and the host's calls that wait for the device
(synchronisations and blocking copies) with their count and time.  A step whose device idles is
bound by its host: fewer launches and waits shorten it, fewer Gaussians do not.
``HostProfile`` then says which Python code holds such a step (Python's own profiler, no GPU
needed).
"""
import gzip
import json
import re
import tempfile
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_API_CATEGORIES = ("cuda_runtime", "cuda_driver")
WAITS = ("Synchronize", "cuMemcpyDtoH_v2", "cudaMemcpy ", "cuMemcpyDtoH")  # host calls that wait for the device
STEP_MARK = "numbasplat_step"


def check_available(backend=None):
    """Raise SystemExit with the reason where no timeline can be recorded: ``backend`` (None: the
    process default) is not a GPU's, or torch is missing."""
    from numbasplat import backend as _backend
    if not _backend.on_gpu(backend):
        raise SystemExit(f"error: --timeline records a GPU's steps; this run's backend is "
                         f"{backend or _backend.BACKEND}{' (the CUDA simulator)' if _backend.SIM else ''}")
    _torch()


def _torch():
    try:
        import torch
        import torch.profiler
    except ImportError as e:
        raise SystemExit(f"error: the timeline needs torch (torch.profiler records CUPTI's trace): {e}")
    return torch


def _profiler():
    """(torch, a new CUPTI profiler of host and device activity, torch's ``record_function``)."""
    torch = _torch()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    return torch, torch.profiler.profile(activities=activities), torch.profiler.record_function


def _events(prof, keep):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    if keep:
        with gzip.open(keep, "wt") as f:
            f.write(text)
    return json.loads(text)["traceEvents"]


def record(step, steps, keep=None):
    """Run ``step()`` ``steps`` times under CUPTI, each in a host range named ``STEP_MARK``; the
    device is waited for before and after, not between steps (as in training).  -> the trace's
    events (chrome trace format), also written to the path ``keep`` if given (gzipped JSON that
    Perfetto and chrome://tracing open)."""
    from numbasplat import backend as _backend
    _, prof, record_function = _profiler()
    _backend.synchronize("cuda")
    with prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                step()
        _backend.synchronize("cuda")  # (inside: the last steps' kernels are in the trace)
    return _events(prof, keep)


class TrainingTimeline:
    """A ``Trainer.step_hooks`` hook (``run.py train --timeline START:STEPS``): records steps START + 1
    to START + STEPS of the training itself under CUPTI (a step mark from the end of one step's
    loop to the end of the next: the loop's own work included), then logs ``report_lines`` and
    keeps the trace at ``keep``.  Steps under the profiler run slower; training goes on after."""

    def __init__(self, start, steps, keep=None, log=print):
        if start < 0 or steps < 2:
            raise ValueError(f"--timeline START:STEPS needs START >= 0 and STEPS >= 2, got {start}:{steps}")
        check_available()
        self.start, self.steps, self.keep, self.log = start, steps, keep, log
        self.prof = self.mark = None

    def __call__(self, trainer, record=None):
        step = trainer.step
        if step == self.start and self.prof is None:
            self.torch, self.prof, self._record_function = _profiler()
            self.prof.__enter__()
        elif self.prof is not None and self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        if self.prof is None:
            return
        if step < self.start + self.steps:
            self.mark = self._record_function(STEP_MARK)
            self.mark.__enter__()
            return
        self.torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        self.start = -1  # done: never again
        for line in report_lines(summarize(_events(prof, self.keep))):
            self.log(line)


class HostProfile:
    """A ``Trainer.step_hooks`` hook (``run.py train --host-profile START:STEPS``): Python's profiler
    over steps START + 1 to START + STEPS, then the functions by their own host time a step (the
    calls that queue kernels included, not what the device does).  Where ``--timeline`` shows a
    step bound by its host, this says which Python code holds it.  The profiler slows each
    Python call, so the report ranks; its absolute times are high.  A second list ranks by cumulative
    time, which finds a rare phase's cost (a refinement's, every hundred steps) among its callees."""
    TOP = 25  # functions listed by own time
    TOP_CUMULATIVE = 20  # and by cumulative time

    def __init__(self, start, steps, log=print):
        if start < 0 or steps < 2:
            raise ValueError(f"--host-profile START:STEPS needs START >= 0 and STEPS >= 2, got {start}:{steps}")
        self.start, self.steps, self.log = start, steps, log
        self.prof = None

    def __call__(self, trainer, record=None):
        import cProfile
        if trainer.step == self.start and self.prof is None:
            self.prof = cProfile.Profile()
            self.prof.enable()
        elif self.prof is not None and trainer.step >= self.start + self.steps:
            self.prof.disable()
            prof, self.prof, self.start = self.prof, None, -1  # done: never again
            for line in host_profile_lines(prof, self.steps, self.TOP) + host_profile_lines(
                    prof, self.steps, self.TOP_CUMULATIVE, by="cumulative"):
                self.log(line)


def host_profile_lines(prof, steps, top, by="own"):
    """The ``top`` functions of the profile ``prof`` by ``by`` ("own" or "cumulative") time, in
    microseconds and calls a step."""
    import pstats
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    total = sum(own for _, _, own, _, _ in stats.values())
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2 if by == "own" else 3])[:top]
    lines = [f"host profile ({steps} steps): {total / steps * 1e6:.0f} us a step of Python-visible time under "
             f"the profiler; functions by {by} time (us a step, calls a step, cumulative us a step):"]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if file != "~" else "built-in"
        lines.append(f"  {own / steps * 1e6:8.1f} {calls / steps:7.1f} {cum / steps * 1e6:9.1f}  {name} ({where})")
    return lines


def _union_length(intervals):
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(events):
    """Per step (median over the steps, milliseconds): the host's time, the device's busy time
    and the step's device idle time, kernels launched, and the host's waits for the device
    (count and time).  Also the kernels of the run by device time (``kernel_name``s, the longest
    ``TOP_KERNELS``), with their milliseconds and launches per step.
    Steps are the host ranges ``record`` marks; the device's work is counted to the step whose
    launch calls it came from (CUPTI's correlation ids)."""
    import statistics
    marks = sorted((e["ts"], e["ts"] + e["dur"]) for e in events  # (the host's ranges: not their GPU copies)
                   if e.get("ph") == "X" and e.get("name") == STEP_MARK and e.get("cat") == "user_annotation")
    if not marks:
        raise ValueError("the trace holds no steps")

    def step_of(ts):
        for i, (a, b) in enumerate(marks):
            if a <= ts <= b:
                return i
        return None
    api = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_API_CATEGORIES]
    launched_in = {}
    for e in api:
        corr = e.get("args", {}).get("correlation")
        s = step_of(e["ts"])
        if corr is not None and s is not None:
            launched_in[corr] = s
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    per_step = [{"busy": [], "kernels": 0, "waits": 0, "wait_us": 0.0} for _ in marks]
    by_kernel = {}  # short name -> [launches, microseconds] over the steps
    for e in device:
        s = launched_in.get(e.get("args", {}).get("correlation"))
        if s is None:
            continue
        per_step[s]["busy"].append((e["ts"], e["ts"] + e["dur"]))
        if e["cat"] == "kernel":
            per_step[s]["kernels"] += 1
            k = by_kernel.setdefault(kernel_name(e["name"]), [0, 0.0])
            k[0] += 1
            k[1] += e["dur"]
    for e in api:
        s = step_of(e["ts"])
        if s is not None and any(w in e["name"] for w in WAITS):
            per_step[s]["waits"] += 1
            per_step[s]["wait_us"] += e["dur"]
    rows = _step_rows(marks, per_step)
    if not rows:
        raise ValueError("the trace has too few steps with device work (at least 2 are needed)")
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    summary["top_kernels"] = [(k, us / 1e3 / len(per_step), n / len(per_step)) for k, (n, us) in top]
    summary["steps"] = len(rows)
    return summary


def _step_rows(marks, per_step):
    """One row (milliseconds) per step with device work and a next step that has some: the host's time
    (its range in ``marks``), the step's span on the device (from its first work to the next step's
    first work), the device's busy time in it (``per_step``'s intervals, united) and idle time, its
    kernels, and the host's waits."""
    starts = [min(a for a, _ in p["busy"]) if p["busy"] else None for p in per_step]
    rows = []
    for i, p in enumerate(per_step):
        if not p["busy"] or i + 1 >= len(per_step) or starts[i + 1] is None:
            continue
        span = starts[i + 1] - starts[i]
        busy = _union_length(p["busy"])
        rows.append({"host_ms": (marks[i][1] - marks[i][0]) / 1e3, "device_span_ms": span / 1e3,
                     "device_busy_ms": busy / 1e3, "device_idle_ms": (span - busy) / 1e3,
                     "kernels": p["kernels"], "waits": p["waits"], "wait_ms": p["wait_us"] / 1e3})
    return rows


TOP_KERNELS = 16  # kernels listed in a report, the longest first


def kernel_name(name):
    """A kernel's name without what makes it unreadable: Numba's ``numbasplat::cuda::raster::
    _project_kernel[abi:...]...`` as ``raster._project_kernel``, others without their template
    arguments, return type and CUB's versioned namespace."""
    m = re.match(r"(?:void )?numbasplat::cuda::(\w+)::(\w+)", name)
    if m:
        return f"{m.group(1)}.{m.group(2)}"
    short = re.sub(r"^void ", "", name.split("<", 1)[0])
    return re.sub(r"::CUB_\w+::", "::", short)


def report_lines(summary):
    s = summary
    lines = [f"timeline (CUPTI, median of {s['steps']} unsynced steps): host {s['host_ms']:.2f} ms a step; "
             f"device span {s['device_span_ms']:.2f} ms, busy {s['device_busy_ms']:.2f}, idle "
             f"{s['device_idle_ms']:.2f}; {s['kernels']:.0f} kernels; {s['waits']:.0f} host waits "
             f"({s['wait_ms']:.2f} ms)",
             "  kernels by device time (ms a step, launches a step):"]
    lines += [f"    {ms:7.3f} {n:5.1f}  {name[:100]}" for name, ms, n in s["top_kernels"]]
    return lines
