"""``bench``, ``scaling`` and ``info``: how fast, on how many ranks, on what."""
import argparse
import os
import sys

from .args import TRANSPORTS, byte_size, count, mpi_comm, nonnegative, positive


def cmd_bench(a):
    from data.bench_scene import MAKE_HINT, load_scene
    from numbasplat import bench
    if a.make is not None:
        return make_scene(a)
    if a.out is not None or a.res is not None:
        raise ValueError("--out and --res are for bench --make (the scene to write)")
    if not os.path.isfile(a.scene):
        raise SystemExit(f"error: benchmark scene not found: {a.scene} ({MAKE_HINT})")
    if a.deterministic and a.loss == "tile":
        raise SystemExit("error: --deterministic cannot be combined with --loss tile (its fused kernel adds "
                         "gradients with atomics)")
    bench.run(load_scene(a.scene), iters=a.iters, warmup=a.warmup, sh_degree=a.sh_degree, profile=a.profile,
              loss=a.loss, fuse=not a.no_fuse, deterministic=a.deterministic, virtual_devices=a.virtual_devices,
              into_room=a.graphs, graphs=a.graphs, fuse_adam=None if a.adam is None else a.adam == "fused",
              compare_adam=a.adam is None)


def make_scene(a):
    """``bench --make N --out FILE.npz [--res WxH]``: write a standard benchmark scene of N Gaussians
    (data/bench_scene.py ``make_scene``), that ``bench --scene FILE.npz`` then times."""
    import numpy as np
    from data import bench_scene
    from data.atomic import atomic_path
    if a.out is None:
        raise ValueError("bench --make needs --out FILE.npz, the scene file to write")
    width, height = a.res or bench_scene.STANDARD_SIZES.get(a.make, bench_scene.DEFAULT_SIZE)
    scene = bench_scene.make_scene(a.make, width, height, seed=a.seed)
    with atomic_path(a.out) as tmp, open(tmp, "wb") as f:  # (a file object: np.savez adds no .npz to the name)
        np.savez(f, **scene)
    print(f"wrote {a.out}: {a.make} Gaussians, {width}x{height}, seed {a.seed}")


def gaussian_count(text):
    """argparse type of ``--make``: a count of Gaussians, at least 1, as 2000, 100k, 1M or 2.5M."""
    multiplier = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    digits = text[:-1] if multiplier > 1 else text
    try:
        value = float(digits) * multiplier
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count such as 2000, 100k or 1M, got {text!r}") from None
    if not (value >= 1 and value == int(value)):
        raise argparse.ArgumentTypeError(f"expected a whole count of at least 1, got {text!r}")
    return int(value)


def resolution(text):
    """argparse type of ``--res``: WIDTHxHEIGHT in pixels, as 1297x840."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 1297x840, got {text!r}") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"width and height must be at least 1, got {text!r}")
    return width, height


def cmd_scaling(a):
    """Training images/s and phases on a benchmark scene, a dataset or a trained model (engine/tools/scaling.py)."""
    if a.scene is not None and not os.path.isfile(a.scene):
        from data.bench_scene import MAKE_HINT
        raise SystemExit(f"error: benchmark scene not found: {a.scene} ({MAKE_HINT})")
    import tempfile
    from engine.tools import scaling
    if a.timeline:
        from engine.tools.timeline import check_available
        check_available()  # before the workload renders
    comm = mpi_comm(batched=a.pipeline == "gaussian-exchange")
    if a.pipeline == "single" and comm is not None:
        raise ValueError(f"--pipeline single runs on one rank, not {comm.Get_size()}: leave it out under mpiexec")
    options = dict(iters=a.iters, warmup=a.warmup, grad_comm=a.grad_comm, transport=a.transport,
                   model_ranks=a.model_ranks, link_gbs=a.link_gbs or scaling.NVLINK_GBS,
                   link_latency_s=scaling.NVLINK_LATENCY_S if a.link_latency_us is None else 1e-6 * a.link_latency_us,
                   balanced=a.model_bounds == "balanced", loss=a.loss, timeline=a.timeline,
                   timeline_trace=a.timeline_trace,
                   offload=None if a.offload == "none" else dict(offload=a.offload, offload_dir=a.offload_dir,
                                                                 host_memory=a.host_memory, gpu_memory=a.gpu_memory))
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:  # --model's trainer writes nothing there
        if comm is None:
            return scaling.run(_workload(a, scaling, tmp), **options)
        from comm import abort_on_error
        from engine.pipelines.distributed import select_device
        with abort_on_error(comm):
            select_device(comm)
            scaling.run(_workload(a, scaling, tmp), comm=comm, **options)


def _workload(a, scaling, tmp):
    """What ``scaling`` trains on: ``--scene``'s renders, ``--data``'s training views, or ``--model``
    on the training views of its capture (as its cfg.json records it)."""
    if a.scene is not None:
        return scaling.scene_workload(a.scene, a.views)
    if a.model is not None:
        import argparse
        from .evaluate import data_defaults, trained_model
        capture = argparse.Namespace(**dict.fromkeys(data_defaults()), model=a.model, out=tmp)  # as cfg.json has them
        return scaling.model_workload(trained_model(capture), a.views)
    return scaling.data_workload(a.data, a.views)


def rank_counts(text):
    """argparse type of ``--model-ranks``: rank counts of at least 1, comma-separated (2,4,8)."""
    parse = count(1)
    return tuple(parse(part.strip()) for part in text.split(","))


CUDA_MAJORS = ("12", "13")  # one gpu extra each: gpu-cu12, gpu-cu13 (pyproject.toml)
GPU_DISTRIBUTIONS = ("numba-cuda", "cuda-bindings", "cupy",
                     *(f"cupy-cuda{m}x" for m in CUDA_MAJORS), *(f"nvidia-nccl-cu{m}" for m in CUDA_MAJORS))


def installed_versions(names):
    """``{distribution: version}`` of those of ``names`` that are installed (pip or conda metadata)."""
    from importlib import metadata
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def cuda_extra(versions):
    """Which gpu extra the installed wheels make up, from ``{distribution: version}``, as ``info`` says it.

    The CuPy wheel names the CUDA major (cupy-cuda13x: gpu-cu13); the extra's NCCL wheel and
    numba-cuda's bindings for the same major complete it.
    """
    wheels = [m for m in CUDA_MAJORS if f"cupy-cuda{m}x" in versions]
    if len(wheels) > 1:
        names = " and ".join(f"cupy-cuda{m}x" for m in wheels)
        return f"mixed: {names} are both installed and shadow each other; pip uninstall all but one"
    if not wheels:
        if "cupy" in versions:
            return f"none: CuPy {versions['cupy']} comes from conda-forge or a source build"
        return 'none: no CuPy, CPU backend only (pip install -e ".[gpu-cu12]" or ".[gpu-cu13]" for a GPU)'
    major = wheels[0]
    extra, cupy, nccl = f"gpu-cu{major}", f"cupy-cuda{major}x", f"nvidia-nccl-cu{major}"
    parts, missing = [f"{cupy} {versions[cupy]}"], []
    if nccl in versions:
        parts.append(f"{nccl} {versions[nccl]}")
    else:
        missing.append(f"no {nccl}")
    bindings = versions.get("cuda-bindings")
    if bindings:
        parts.append(f"cuda-bindings {bindings}")
        if bindings.split(".")[0] != major:
            missing.append(f"numba-cuda's cuda-bindings {bindings} is for another CUDA")
    line = f"{extra} ({', '.join(parts)})"
    if missing:
        line += f"; incomplete: {', '.join(missing)} (pip install -e \".[{extra}]\")"
    return line


def _cuda_version(code):
    """CUDA's version integers (12090: 12.9) as text."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _first_line(exc):
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _cupy_line():
    try:
        import cupy
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "cupy":
            return "CuPy: not installed"
        return f"CuPy: does not load ({_first_line(e)})"  # installed, but a CUDA library it needs is not
    runtime = cupy.cuda.runtime
    line = f"CuPy: {cupy.__version__}, CUDA runtime {_cuda_version(runtime.runtimeGetVersion())}"
    try:
        return f"{line}, driver {_cuda_version(runtime.driverGetVersion())}"
    except Exception as e:  # no driver on this machine
        return f"{line}, no driver ({_first_line(e)})"


def _numba_cuda_line(versions):
    try:
        from numba import cuda
        major, minor = cuda.runtime.get_version()
        toolkit = f"CUDA toolkit {major}.{minor}"
    except Exception as e:  # no toolkit wheels (the gpu extras bring them) nor a CUDA install
        toolkit = f"no CUDA toolkit found ({_first_line(e)})"
    bindings = f" (cuda-bindings {versions['cuda-bindings']})" if "cuda-bindings" in versions else ""
    return f"numba-cuda: {versions.get('numba-cuda', 'not installed')}, {toolkit}{bindings}"


def _nccl_line():
    from comm.libraries import load_nccl, loaded_libraries
    nccl, why = load_nccl()
    if nccl is None:
        return f"NCCL: unavailable ({why})"
    v = nccl.get_version()
    where = ", ".join(loaded_libraries("libnccl")) or "library path unknown"
    return f"NCCL: {v // 10000}.{v % 10000 // 100}.{v % 100} ({where})"


def _mpi_line():
    from comm.libraries import MPIUnavailable, load_mpi, loaded_libraries, mpi_library_name
    try:
        MPI = load_mpi()
    except MPIUnavailable as e:
        return f"MPI: unavailable: {e}"
    from comm.alltoallv import cuda_aware_mpi
    import mpi4py
    where = ", ".join(loaded_libraries("libmpi")) or "library path unknown"
    return (f"MPI: {mpi_library_name(MPI)} ({where}), mpi4py {mpi4py.__version__}, "
            f"CUDA-aware: {'yes' if cuda_aware_mpi() else 'no'}")


def cmd_info(a):
    """What this install runs on: backend, GPU, the CUDA extra and its libraries, MPI.

    Libraries that do not load are one line each saying why; what they would print while failing
    (dlopen errors, CuPy's and mpi4py's warnings) is not shown.
    """
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for line in _info_lines(installed_versions(GPU_DISTRIBUTIONS)):
            print(line, flush=True)


def _info_lines(versions):
    """The lines of ``info``, one by one (each printed as soon as it is known)."""
    import numba
    import numpy as np
    from numbasplat import backend as _backend
    yield f"numbasplat backend: {_backend.BACKEND}{' (CUDA simulator)' if _backend.SIM else ''}"
    yield f"python {sys.version.split()[0]}, numpy {np.__version__}, numba {numba.__version__}"
    yield _gpu_line(_backend)
    if _backend.on_gpu():
        yield _peer_line()
    yield f"CUDA extra: {cuda_extra(versions)}"
    yield _cupy_line()
    yield _numba_cuda_line(versions)
    yield _nccl_line()
    yield _mpi_line()


def _gpu_line(_backend):
    try:
        from numba import cuda
        if cuda.is_available() and _backend.on_gpu("cuda"):
            d = cuda.get_current_device()
            return (f"GPU: {d.name.decode() if isinstance(d.name, bytes) else d.name}, "
                    f"compute capability {d.compute_capability}")
        return "GPU: none"
    except Exception as e:  # no numba-cuda or driver
        return f"GPU: none ({e.__class__.__name__})"


def _peer_line():
    """The GPUs' peer access (NVLink or PCIe P2P: what ``train --devices`` needs, or
    ``--devices-allow-pcie``), one pair a word."""
    try:
        from numbasplat.device import peer_access
        pairs = peer_access()
    except Exception as e:  # no CuPy or driver
        return f"GPU peer access: unknown ({_first_line(e)})"
    if not pairs:
        return "GPU peer access: one GPU visible"
    words = [f"{i}->{j} {'yes' if ok else 'no'}" for (i, j), ok in sorted(pairs.items())]
    verdict = "every pair" if all(pairs.values()) else "not every pair: train --devices needs --devices-allow-pcie"
    return f"GPU peer access ({verdict}): " + ", ".join(words)


def add_commands(sub):
    b = sub.add_parser("bench", help="time full training steps on a benchmark scene (.npz), or make one (--make)")
    what = b.add_mutually_exclusive_group(required=True)
    what.add_argument("--scene", help="the scene to time: an .npz written by --make")
    what.add_argument("--make", type=gaussian_count, metavar="N",
                      help="write a standard benchmark scene of N Gaussians (2000, 100k, 1M, 6M) to --out and exit: "
                           "random Gaussians before one camera, 1297x840 (6M: 1920x1080), as BENCHMARKS.md's")
    b.add_argument("--out", metavar="FILE.npz", help="with --make: the scene file to write")
    b.add_argument("--res", type=resolution, metavar="WxH", help="with --make: the camera's size instead")
    b.add_argument("--seed", type=int, default=0, help="with --make: the random seed (0: the standard scenes)")
    b.add_argument("--iters", type=count(1), default=20)
    b.add_argument("--warmup", type=count(0), default=3)
    b.add_argument("--sh-degree", type=int, choices=range(4), default=None)
    b.add_argument("--profile", action="store_true", help="also print the host-side Python profile")
    b.add_argument("--loss", choices=["global", "tile"], default="global")
    b.add_argument("--no-fuse", action="store_true", help="with --loss tile: the unfused kernels only")
    b.add_argument("--deterministic", action="store_true",
                   help="binning and raster backward as train --deterministic runs them (a fixed order of sums)")
    b.add_argument("--virtual-devices", type=count(1), default=1, metavar="N",
                   help="every stage split N ways as train --virtual-devices splits it (the aggregate device's "
                        "overhead on one device)")
    b.add_argument("--adam", choices=["fused", "separate"],
                   help="time the step with Adam's update fused into the projection backward's kernels, or after "
                        "them, alone (default: as training runs it by default, separate; then the other too, for "
                        "comparison, unless --virtual-devices)")
    b.add_argument("--graphs", action="store_true",
                   help="time replays of one CUDA graph of the step, binning into the first step's room, as "
                        "training's step graphs run it (the step alone, not its stages)")
    b.set_defaults(fn=cmd_bench)
    c = sub.add_parser("scaling", help="training images/s and the step's phases on a benchmark scene or a dataset, "
                                       "one rank or many (mpiexec); on one rank bytes per step and a cost model")
    what = c.add_mutually_exclusive_group(required=True)
    what.add_argument("--scene", help=".npz written by bench --make (trains on renders of it)")
    what.add_argument("--data", help="a dataset folder with the ground-truth Gaussians in ground_truth.ply "
                                     "(run.py synth writes one), at full resolution")
    what.add_argument("--model", help="a training folder or snapshot: its model as trained, on its capture's "
                                      "training views (as its cfg.json records them)")
    c.add_argument("--views", type=count(1), default=None,
                   help="--scene: renders to train on (default 8); --data, --model: the first N training views "
                        "(default all)")
    c.add_argument("--loss", choices=["global", "tile"], default="global",
                   help="the training loss (tile: the fused kernel on GPUs)")
    c.add_argument("--iters", type=count(1), default=30, help="timed steps")
    c.add_argument("--warmup", type=count(0), default=5)
    c.add_argument("--pipeline", choices=["auto", "single", "gaussian-exchange"], default="auto",
                   help="on one process: single-GPU (auto) or the Gaussian-exchange one on one rank; under mpiexec "
                        "always the Gaussian-exchange one")
    c.add_argument("--grad-comm", choices=["sparse", "dense"], default="sparse")
    c.add_argument("--transport", choices=TRANSPORTS, default="auto")
    c.add_argument("--model-ranks", type=rank_counts, default=(), metavar="P,P,...",
                   help="on one rank: bytes per step and the cost model's step time for these rank counts (2,4,8)")
    c.add_argument("--model-bounds", choices=["balanced", "even"], default="balanced",
                   help="the modelled renderers' tile ranges: balanced by the batch's intersections, or even")
    c.add_argument("--link-gbs", type=positive, default=None, metavar="GB/s",
                   help="the cost model's link, gigabytes per second per GPU and direction (default: NCCL's "
                        "effective NVLink 4 bandwidth, engine/tools/scaling.py NVLINK_GBS)")
    c.add_argument("--link-latency-us", type=nonnegative, default=None, metavar="US",
                   help="the cost model's time a round between two ranks costs beyond its bytes (a collective of P "
                        "ranks takes log2 P rounds), microseconds (default: NCCL's smallest messages over NVLink, "
                        "engine/tools/scaling.py NVLINK_LATENCY_S)")
    c.add_argument("--timeline", type=count(0), default=0, metavar="STEPS",
                   help="then this many steps under CUPTI (needs torch): kernels, device busy and idle time and "
                        "host waits per step (engine/tools/timeline.py)")
    c.add_argument("--timeline-trace", default=None, metavar="FILE.json.gz",
                   help="with --timeline: also write the trace there (Perfetto or chrome://tracing open it)")
    c.add_argument("--offload", choices=["none", "host", "disk"], default="none",
                   help="the model out of core, as train --offload: on one rank also where the device's bytes per "
                        "working-set Gaussian go and the largest model each tier holds here")
    c.add_argument("--offload-dir", default=None, metavar="PATH", help="with --offload disk: the blocks' folder")
    c.add_argument("--host-memory", type=byte_size, default=None, metavar="BYTES",
                   help="with --offload disk: host memory for the cache of blocks")
    c.add_argument("--gpu-memory", type=byte_size, default=None, metavar="BYTES",
                   help="with --offload: device memory for the blocks and the working sets (default: 80%% of the free)")
    c.set_defaults(fn=cmd_scaling)
    i = sub.add_parser("info", help="print the backend, GPU, MPI and versions")
    i.set_defaults(fn=cmd_info)
