"""Packaging consistency: pyproject.toml, environment.yml, environment-gpu.yml, README.md and .ci/run.

These compare the real files, so they fail when one is edited and the other is
not: environment.yml must list the same dependency names, with the same version
bounds, as pyproject.toml's runtime dependencies plus its `test`, `mpi`, `metrics` and `viewer`
extras; environment-gpu.yml the same plus the conda-forge counterparts of the
gpu-cu12 extra; README.md must hold the quick-start and test commands that
.ci/run runs, and the install instructions for the extras and the cluster MPI.
"""
import os
import re
import stat
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

DEMO_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python run.py"
TEST_COMMAND = (
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest -q -n auto'
)

# conda-forge name -> PyPI name, where they differ.
CONDA_TO_PYPI = {
    "numba-cuda": "numba-cuda",
    "pillow": "pillow",
    "pytorch": "torch",
}
# conda-only entries of environment.yml that are not Python dependencies.
CONDA_ONLY = {"python", "pip"}
# pyproject extras that environment.yml must carry besides the runtime deps: the tests' and all the
# optional outputs' (LPIPS and the viewer too, which the test extra leaves out).
ENV_EXTRAS = ("test", "mpi", "metrics", "viewer")
# What those extras have that environment.yml leaves out: the test extra's CUDA compilers (the PTX
# tests skip without them, as they always did on conda; environment-gpu.yml has cuda-nvcc, cuda-nvrtc).
PYPI_ONLY = {"cuda-toolkit"}
# PyPI wheel of a gpu extra -> its conda-forge package (environment-gpu.yml follows gpu-cu12).
GPU_PYPI_TO_CONDA = {"cupy-cuda12x": "cupy", "nvidia-nccl-cu12": "nccl", "numba-cuda": "numba-cuda"}
# What the wheels bring that conda-forge has as packages of its own: the CUDA major, NVVM, NVRTC.
GPU_CONDA_ONLY = {"cuda-version", "cuda-nvcc", "cuda-nvrtc"}
ENV_FILES = ("environment.yml", "environment-gpu.yml")
SELF_INSTALL = "pip install --no-deps -e ."


# --------------------------------------------------------------------------- helpers

def norm_name(name):
    """PEP 503-style normalisation: lowercase, runs of -_. become '-'."""
    return re.sub(r"[-_.]+", "-", name.strip().lower())


_NAME_RE = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[^\]]*\])?\s*(.*?)\s*$")
_CLAUSE_RE = re.compile(r"^(===|==|!=|<=|>=|~=|<|>|=)?\s*(\S+)$")


def parse_requirement(text):
    """'numpy >=1.24, <2.5 ; marker' -> ('numpy', frozenset({('>=','1.24'), ('<','2.5')})).

    Works for PEP 508 strings and conda match specs (channel prefix, extras and
    environment markers are dropped)."""
    text = text.split(";", 1)[0]
    if "::" in text:  # conda channel prefix, e.g. conda-forge::numpy
        text = text.split("::", 1)[1]
    m = _NAME_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse requirement {text!r}")
    name, _extras, spec = m.groups()
    clauses = set()
    for part in spec.split(","):
        part = part.replace(" ", "")
        if not part:
            continue
        c = _CLAUSE_RE.match(part)
        if not c:
            raise ValueError(f"cannot parse version clause {part!r} of {text!r}")
        op, ver = c.groups()
        clauses.add((op or "==", ver))
    return norm_name(name), frozenset(clauses)


def requirements_map(specs, rename=None):
    out = {}
    for spec in specs:
        name, clauses = parse_requirement(spec)
        name = norm_name((rename or {}).get(name, name))
        if name in out and out[name] != clauses:
            raise ValueError(f"{name} listed twice with different bounds: {out[name]} / {clauses}")
        out[name] = clauses
    return out


def _scalar(value):
    value = value.strip()
    if value[:1] in "\"'" and value[-1:] == value[:1] and len(value) >= 2:
        return value[1:-1]
    if value.startswith("[") and value.endswith("]"):  # simple flow list: [a, b]
        return [_scalar(v) for v in value[1:-1].split(",") if v.strip()]
    return value


def _strip_comment(line):
    if line.lstrip().startswith("#"):
        return ""
    # a ' #' starts a comment (good enough for environment files: no quoted '#')
    return re.split(r"\s+#", line, maxsplit=1)[0].rstrip()


_KEY_RE = re.compile(r"^([A-Za-z_][\w.-]*):(?:\s+(.*))?$")


def parse_simple_yaml(text):
    """A tiny YAML subset parser: nested block mappings and lists of scalars or
    one-key mappings (``- pip:``), plus simple flow lists.  Enough for
    environment.yml; raises ValueError on anything else."""
    lines = []
    for raw in text.splitlines():
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise ValueError("tabs in YAML indentation")
        line = _strip_comment(raw)
        if line.strip():
            lines.append((len(line) - len(line.lstrip(" ")), line.strip()))

    def block(i, indent):
        is_list = lines[i][1].startswith("- ") or lines[i][1] == "-"
        result = [] if is_list else {}
        while i < len(lines) and lines[i][0] == indent:
            content = lines[i][1]
            if is_list:
                if not (content.startswith("- ") or content == "-"):
                    raise ValueError(f"mixed list/mapping at line {content!r}")
                item = content[1:].strip()
                k = _KEY_RE.match(item)
                if k and k.group(2) is None:  # "- key:" with a nested block
                    if i + 1 >= len(lines) or lines[i + 1][0] <= indent:
                        result.append({k.group(1): None})
                        i += 1
                    else:
                        value, i = block(i + 1, lines[i + 1][0])
                        result.append({k.group(1): value})
                elif k:  # "- key: value"
                    result.append({k.group(1): _scalar(k.group(2))})
                    i += 1
                else:
                    result.append(_scalar(item))
                    i += 1
            else:
                k = _KEY_RE.match(content)
                if not k:
                    raise ValueError(f"expected 'key: value', got {content!r}")
                key, value = k.groups()
                if value is not None:
                    result[key] = _scalar(value)
                    i += 1
                elif i + 1 < len(lines) and (
                    lines[i + 1][0] > indent
                    or (lines[i + 1][0] == indent and lines[i + 1][1].startswith("-"))
                ):
                    result[key], i = block(i + 1, lines[i + 1][0])
                else:
                    result[key] = None
                    i += 1
        if i < len(lines) and lines[i][0] > indent:
            raise ValueError(f"unexpected indentation at {lines[i][1]!r}")
        return result, i

    if not lines:
        return {}
    data, i = block(0, lines[0][0])
    if i != len(lines):
        raise ValueError(f"could not parse from {lines[i][1]!r}")
    return data


def compare_dependencies(expected, actual):
    """Differences between two {name: clauses} maps, as readable strings."""
    problems = []
    for name in sorted(set(expected) - set(actual)):
        problems.append(f"{name}: in pyproject.toml, missing from environment.yml")
    for name in sorted(set(actual) - set(expected)):
        problems.append(f"{name}: in environment.yml, missing from pyproject.toml")
    for name in sorted(set(expected) & set(actual)):
        if expected[name] != actual[name]:
            problems.append(
                f"{name}: bounds differ: pyproject {sorted(expected[name])} vs environment.yml {sorted(actual[name])}"
            )
    return problems


def load_pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def load_environment(name="environment.yml"):
    return parse_simple_yaml((ROOT / name).read_text())


def env_conda_and_pip(env):
    conda, pip = [], []
    for dep in env.get("dependencies") or []:
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, f"unexpected mapping in dependencies: {dep}"
            pip.extend(dep["pip"] or [])
        else:
            conda.append(dep)
    return conda, pip


def pyproject_expected(pp):
    project = pp["project"]
    specs = list(project["dependencies"])
    for extra in ENV_EXTRAS:
        specs += project["optional-dependencies"][extra]
    return {name: bounds for name, bounds in requirements_map(specs).items() if name not in PYPI_ONLY}


def extra_requirements(pp, extra):
    """The requirements an extra stands for, with ``numbasplat[other]`` aliases expanded."""
    from packaging.requirements import Requirement
    out = []
    for spec in pp["project"]["optional-dependencies"][extra]:
        req = Requirement(spec)
        if norm_name(req.name) == pp["project"]["name"]:
            for other in sorted(req.extras):
                out += extra_requirements(pp, other)
        else:
            out.append(req)
    return out


def conda_python_deps(conda):
    return requirements_map([c for c in conda if parse_requirement(c)[0] not in CONDA_ONLY], rename=CONDA_TO_PYPI)


def readme_test_command_lines(text):
    m = re.search(r"<!-- test-command -->\n(.*?)<!-- /test-command -->", text, re.S)
    assert m, "README.md lacks the <!-- test-command --> ... <!-- /test-command --> block"
    return [ln for ln in m.group(1).splitlines() if ln.strip() and not ln.strip().startswith("```")]


# --------------------------------------------------------------------------- real files

def test_environment_matches_pyproject():
    pp, env = load_pyproject(), load_environment()
    conda, _pip = env_conda_and_pip(env)
    actual = conda_python_deps(conda)
    expected = pyproject_expected(pp)
    problems = compare_dependencies(expected, actual)
    assert not problems, "environment.yml and pyproject.toml disagree:\n" + "\n".join(problems)
    for name in ("mpi4py", "mpich", "numba", "numba-cuda", "numpy", "h5py", "pillow", "lpips", "torch", "viser"):
        assert name in actual, name


def test_gpu_environment_is_the_cpu_one_plus_the_gpu_extra():
    """environment-gpu.yml: environment.yml's packages with the same bounds, plus gpu-cu12's conda counterparts."""
    pp = load_pyproject()
    cpu, _ = env_conda_and_pip(load_environment())
    gpu, _ = env_conda_and_pip(load_environment("environment-gpu.yml"))
    cpu_deps = conda_python_deps(cpu)
    gpu_deps = requirements_map(gpu, rename=CONDA_TO_PYPI)
    for name, bounds in cpu_deps.items():
        assert gpu_deps.get(name) == bounds, f"environment-gpu.yml: {name} {gpu_deps.get(name)} != {bounds}"
    gpu_wheels = {norm_name(r.name) for r in extra_requirements(pp, "gpu-cu12")}
    assert set(GPU_PYPI_TO_CONDA) == gpu_wheels, "map every wheel of gpu-cu12 to its conda-forge package"
    expected = set(cpu_deps) | set(GPU_PYPI_TO_CONDA.values()) | GPU_CONDA_ONLY | CONDA_ONLY
    assert set(gpu_deps) == expected, (sorted(set(gpu_deps) - expected), sorted(expected - set(gpu_deps)))
    assert gpu_deps["cuda-version"] == {("=", "12")}, "environment-gpu.yml follows the gpu-cu12 extra"


@pytest.mark.parametrize("name", ENV_FILES)
def test_environment_python_and_self_install(name):
    """Both environments: conda-forge only, pyproject's Python bound, and the project installed by
    ``pip install --no-deps -e .`` afterwards (a pip section would pull PyPI's mpich over conda's)."""
    pp, env = load_pyproject(), load_environment(name)
    assert env["name"] == {"environment.yml": "numbasplat", "environment-gpu.yml": "numbasplat-gpu"}[name]
    assert env["channels"] == ["conda-forge"]
    conda, pip = env_conda_and_pip(env)
    conda_map = requirements_map(conda)
    assert "pip" in conda_map
    py_bound = parse_requirement("python" + pp["project"]["requires-python"])[1]
    assert conda_map.get("python") == py_bound, (conda_map.get("python"), py_bound)
    assert not pip, f"{name}: no pip section (it would install the package's PyPI dependencies): {pip}"
    text = (ROOT / name).read_text()
    assert f"conda env create -f {name} && conda activate {env['name']} && {SELF_INSTALL}" in text


def test_pyproject_contents():
    from packaging.requirements import Requirement
    pp = load_pyproject()
    project = pp["project"]
    assert project["name"] == "numbasplat"
    assert parse_requirement("python" + project["requires-python"])[1] == {(">=", "3.10")}
    deps = requirements_map(project["dependencies"])
    assert deps == {
        "numpy": {(">=", "1.24"), ("<", "2.5")},
        "numba": {(">=", "0.60")},
        "numba-cuda": {(">=", "0.20")},
        "mpi4py": {(">=", "4.1")},
        "mpich": set(),
        "h5py": {(">=", "3.8")},
        "pillow": {(">=", "9")},
        "tqdm": {(">=", "4.60")},
        "pyyaml": {(">=", "6")},
    }
    # the MPI library is part of the base install wherever PyPI's mpich has one (not Windows)
    mpich = next(Requirement(d) for d in project["dependencies"] if d.startswith("mpich"))
    for platform, wanted in (("linux", True), ("darwin", True), ("win32", False)):
        assert mpich.marker.evaluate({"sys_platform": platform}) is wanted, platform
    extras = {k: requirements_map(v) for k, v in project["optional-dependencies"].items()}
    assert {"pytest", "pytest-timeout", "scipy"} <= set(extras["test"])
    assert extras["test"]["pytest"] == {(">=", "7")}
    assert extras["test"]["pytest-timeout"] == {(">=", "2.1")}
    assert extras["test"]["scipy"] == {(">=", "1.10")}
    assert extras["mpi"] == {}, "`mpi` is kept as an empty alias: mpich is a base dependency"

    find = pp["tool"]["setuptools"]["packages"]["find"]
    for pkg in ("numbasplat", "engine", "comm", "data"):
        assert pkg in find["include"] and f"{pkg}.*" in find["include"], pkg
    assert not any(p.startswith("run") or p == "tests" for p in find["include"])

    ini = pp["tool"]["pytest"]["ini_options"]
    assert ini["testpaths"] == ["tests"]
    assert int(ini["timeout"]) > 0
    marker_names = {m.split(":", 1)[0].strip() for m in ini["markers"]}
    assert {"sim", "mpi"} <= marker_names


def test_gpu_extras_one_per_cuda_major():
    """gpu-cuXX for each CUDA major ``info`` knows: CuPy for that CUDA with its libraries ([ctk]),
    numba-cuda's cuXX toolkit, NCCL (Linux)."""
    from cli.bench import CUDA_MAJORS
    pp = load_pyproject()
    extras = pp["project"]["optional-dependencies"]
    assert sorted(k for k in extras if re.fullmatch(r"gpu-cu\d+", k)) == [f"gpu-cu{m}" for m in CUDA_MAJORS]
    for major in CUDA_MAJORS:
        reqs = {norm_name(r.name): r for r in extra_requirements(pp, f"gpu-cu{major}")}
        assert set(reqs) == {f"cupy-cuda{major}x", "numba-cuda", f"nvidia-nccl-cu{major}"}, reqs
        cupy = reqs[f"cupy-cuda{major}x"]
        assert cupy.extras == {"ctk"} and cupy.specifier.contains("14.0") and not cupy.specifier.contains("13.6")
        assert reqs["numba-cuda"].extras == {f"cu{major}"}
        assert reqs[f"nvidia-nccl-cu{major}"].marker.evaluate({"sys_platform": "linux"})
    # `gpu`, the old name, is gpu-cu12
    assert [str(r) for r in extra_requirements(pp, "gpu")] == [str(r) for r in extra_requirements(pp, "gpu-cu12")]


def cuda_majors(requirements):
    """The CUDA major versions a list of ``Requirement`` pins, as ``{"12", "13"}``: through a CUDA-specific
    extra (``numba-cuda[cu12]``), a wheel named for one (``cupy-cuda13x``, ``nvidia-nccl-cu12``) or a
    version of the CUDA packages themselves (``cuda-toolkit==12.*``, ``cuda-bindings<13``)."""
    majors = set()
    for req in requirements:
        majors |= {m.group(1) for extra in req.extras if (m := re.fullmatch(r"cu(\d+)", extra))}
        majors |= set(re.findall(r"(?:-cu|cuda)(\d+)x?$", norm_name(req.name)))
        if norm_name(req.name) in ("cuda-toolkit", "cuda-bindings") and req.specifier:
            majors |= {m for m in ("11", "12", "13", "14") if req.specifier.contains(f"{m}.0", prereleases=True)
                       or req.specifier.contains(f"{m}.9", prereleases=True)} or {"none"}
    return majors


def test_cuda_majors_of_requirements():
    from packaging.requirements import Requirement

    def majors(*specs):
        return cuda_majors([Requirement(s) for s in specs])
    assert majors("numba-cuda[cu12]>=0.20", "pytest") == {"12"}
    assert majors("cupy-cuda13x[ctk]>=14", 'nvidia-nccl-cu13; sys_platform == "linux"') == {"13"}
    assert majors("cuda-toolkit[nvcc,nvrtc]", "numba-cuda>=0.20", "mpich") == set()
    assert majors("cuda-toolkit==12.*") == {"12"} and majors("cuda-bindings>=12.9,<14") == {"12", "13"}


def test_test_extra_combines_with_every_gpu_extra():
    """``pip install -e ".[test,gpu-cu13]"`` resolves: ``test`` pins no CUDA major of its own (it once
    pinned numba-cuda[cu12], which gpu-cu13's numba-cuda[cu13] contradicts), so ``test`` with any gpu
    extra names that extra's major only.  ``test`` still brings what compiles the kernels to PTX
    without a GPU (tests/test_cuda_launch.py): NVVM and ptxas (cuda-toolkit's nvcc) and NVRTC."""
    pp = load_pyproject()
    test = extra_requirements(pp, "test")
    for extra in sorted(pp["project"]["optional-dependencies"]):
        if m := re.fullmatch(r"gpu-cu(\d+)", extra):
            combined = cuda_majors(test + extra_requirements(pp, extra))
            assert combined == {m.group(1)}, f'".[test,{extra}]" pins CUDA majors {sorted(combined)}'
    toolkit = [r for r in test if norm_name(r.name) == "cuda-toolkit"]
    assert toolkit and {"nvcc", "nvrtc"} <= toolkit[0].extras, "the test extra must bring NVVM, ptxas and NVRTC"


def test_console_script_prints_help(capsys):
    """``pip install`` puts a ``numbasplat`` command on the PATH: pyproject's entry point resolves to a
    function that runs the command line (as ``python run.py``), whose --help lists the commands."""
    import importlib
    target = load_pyproject()["project"].get("scripts", {}).get("numbasplat")
    assert target, "pyproject.toml: [project.scripts] lacks numbasplat"
    module, _, name = target.partition(":")
    entry = getattr(importlib.import_module(module), name)
    with pytest.raises(SystemExit) as e:
        entry(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: numbasplat") and all(cmd in out for cmd in ("train", "eval", "view", "bench"))


def test_license_is_apache_2():
    """LICENSE holds the Apache License 2.0 (as gsplat's), and pyproject declares it."""
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS AND CONDITIONS" in text
    license = load_pyproject()["project"].get("license")
    assert license in ("Apache-2.0", {"text": "Apache-2.0"}), license


def test_readme_commands_and_ci_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    assert [b.strip() for b in blocks[:2]] == [DEMO_COMMAND, TEST_COMMAND], (
        "README.md must open with the demo and the test quick-start commands"
    )
    assert readme_test_command_lines(text) == [TEST_COMMAND]
    assert "BENCHMARKS.md" in text
    for needed in ('pip install -e ".[gpu-cu12]"', 'pip install -e ".[gpu-cu13]"', "python run.py info",
                   "conda env create -f environment.yml", "conda env create -f environment-gpu.yml",
                   SELF_INSTALL, "mpich=*=external_*", "openmpi=*=external_*", "--no-binary mpi4py",
                   "MPI4PY_BUILD_MPICC",
                   # the metrics extra without PyPI's CUDA torch, on a machine without a GPU
                   "--index-url https://download.pytorch.org/whl/cpu && pip install -e \".[metrics]\""):
        assert needed in text, f"README.md should show {needed!r}"

    ci = ROOT / ".ci" / "run"
    assert ci.is_file()
    assert os.stat(ci).st_mode & stat.S_IXUSR, ".ci/run must be executable"
    ci_text = ci.read_text()
    assert ci_text.startswith("#!/usr/bin/env bash") or ci_text.startswith("#!/bin/bash")
    assert "set -euo pipefail" in ci_text
    assert "<!-- test-command -->" in ci_text and "README.md" in ci_text, (
        ".ci/run must take its command from README.md's test-command block"
    )


def test_gitignore():
    entries = {ln.strip() for ln in (ROOT / ".gitignore").read_text().splitlines()}
    for e in (".venv/", "__pycache__/", "*.egg-info/", ".whl/", ".data/", "build/", "out/",
              "*.npz", ".pytest_cache/"):
        assert e in entries, e


# --------------------------------------------------------------------------- the checkers themselves

def test_parse_requirement():
    assert parse_requirement("numpy>=1.24,<2.5") == ("numpy", frozenset({(">=", "1.24"), ("<", "2.5")}))
    assert parse_requirement("numpy >=1.24, <2.5") == parse_requirement("numpy>=1.24,<2.5")
    assert parse_requirement("Numba_CUDA[cu12]>=0.20 ; python_version>'3'") == (
        "numba-cuda", frozenset({(">=", "0.20")})
    )
    assert parse_requirement("conda-forge::mpich") == ("mpich", frozenset())


def test_simple_yaml_parser():
    doc = """\
# comment
name: demo
channels:
  - conda-forge
dependencies:
- python>=3.10   # trailing comment
- numpy>=1.24,<2.5
- pip:
    - -e .
- other: [a, b]
"""
    assert parse_simple_yaml(doc) == {
        "name": "demo",
        "channels": ["conda-forge"],
        "dependencies": ["python>=3.10", "numpy>=1.24,<2.5", {"pip": ["-e ."]}, {"other": ["a", "b"]}],
    }
    with pytest.raises(ValueError):
        parse_simple_yaml("a: 1\n    b: 2\n")


def test_compare_detects_differences():
    exp = requirements_map(["numpy>=1.24,<2.5", "h5py>=3.8", "mpich"])
    assert compare_dependencies(exp, requirements_map(["numpy>=1.24,<2.5", "h5py>=3.8", "mpich"])) == []
    problems = compare_dependencies(exp, requirements_map(["numpy>=1.24", "mpich", "scipy"]))
    assert any(p.startswith("numpy: bounds differ") for p in problems)
    assert any(p.startswith("h5py: in pyproject.toml, missing") for p in problems)
    assert any(p.startswith("scipy: in environment.yml, missing") for p in problems)
