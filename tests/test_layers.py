"""The package graph: no import circle, no upward import, one module that names a backend.

Every import of the project's own modules (top level and inside functions) is read from the
source with ``ast``, so the check needs no GPU and imports nothing.  The layers, from the
bottom: numbasplat's shared math, its two backends, its dispatch module, its API; then
``data`` and ``comm`` (each on numbasplat only); then ``engine``; then ``cli/``, ``run.py`` and
``scripts/``.  A module may import its own layer or any below it, never one above; and the engine
and the command line take numbasplat through its API, never from its shared math.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("numbasplat", "data", "comm", "engine", "cli")

# (module prefix, layer): the longest matching prefix decides a module's layer
LAYERS = [
    ("numbasplat.math", 0),
    ("numbasplat.cpu", 1),
    ("numbasplat.cuda", 1),
    ("numbasplat.backend", 2),
    ("numbasplat", 3),
    ("data", 4),
    ("comm", 4),
    ("engine", 5),
    ("cli", 6),
    ("run", 6),
    ("scripts", 6),
]
BACKENDS = ("numbasplat.cpu", "numbasplat.cuda")
# Packages that import numbasplat's API only: what they need of ``numbasplat.math`` (record layouts,
# the tile size, constants) the API re-exports (``numbasplat/__init__.py``), so the math can move
# between numbasplat's modules without them.  (``scripts/`` measure numbasplat's internals, as tests do.)
THROUGH_THE_API = ("engine", "cli", "run")


def _module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources():
    files = [ROOT / "run.py", *sorted((ROOT / "scripts").glob("*.py"))]
    for pkg in PACKAGES:
        files += sorted((ROOT / pkg).rglob("*.py"))
    return {_module_name(f): f for f in files}


def _resolve(name, modules):
    """The project module ``name`` stands for (a package's module or the package), or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod, path, modules):
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            names = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
        else:
            continue
        for n in names:
            target = _resolve(n, modules)
            if target and not (mod == target or mod.startswith(target + ".")):  # (its own packages: not an edge)
                found.add(target)
    return found


def _layer(mod):
    best = max((p for p, _ in LAYERS if mod == p or mod.startswith(p + ".")), key=len, default=None)
    return dict(LAYERS)[best] if best else None


@pytest.fixture(scope="module")
def graph():
    modules = _sources()
    return {m: _imports(m, f, modules) for m, f in modules.items()}


def test_every_module_has_a_layer(graph):
    assert [m for m in graph if _layer(m) is None] == []


def test_no_upward_import(graph):
    upward = sorted(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
                    for m, targets in graph.items() for t in targets if _layer(t) > _layer(m))
    assert upward == []


def test_layers_beside_each_other_stay_apart(graph):
    """data and comm, and the two backends, share a layer but never import each other."""
    apart = [("data", "comm"), ("comm", "data"), ("numbasplat.cpu", "numbasplat.cuda"),
             ("numbasplat.cuda", "numbasplat.cpu")]
    crossing = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                      for a, b in apart if (m == a or m.startswith(a + ".")) and (t == b or t.startswith(b + ".")))
    assert crossing == []


def test_only_the_dispatch_module_names_a_backend(graph):
    outside = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                     if t.startswith(BACKENDS) and not m.startswith(BACKENDS) and m != "numbasplat.backend")
    assert outside == []


def test_the_engine_and_the_cli_take_the_math_from_the_api(graph):
    inside = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                    if (t == "numbasplat.math" or t.startswith("numbasplat.math."))
                    and any(m == p or m.startswith(p + ".") for p in THROUGH_THE_API))
    assert inside == []


def test_no_import_circle(graph):
    """Tarjan's strongly connected components: every one a single module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a made-up tree with all three faults is caught."""
    for name, text in {"numbasplat/__init__.py": "", "numbasplat/math/__init__.py": "",
                       "numbasplat/math/a.py": "from numbasplat import loss\n",
                       "numbasplat/loss.py": "from .math import a\nimport engine.recipe.trainer\n",
                       "engine/__init__.py": "", "engine/recipe/trainer.py": "from numbasplat.math.a import b\n",
                       "run.py": ""}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    modules = _sources()
    g = {m: _imports(m, f, modules) for m, f in modules.items()}
    assert {"numbasplat.math.a", "engine.recipe.trainer"} <= g["numbasplat.loss"]
    with pytest.raises(AssertionError):
        test_no_import_circle(g)
    with pytest.raises(AssertionError):
        test_no_upward_import(g)
    with pytest.raises(AssertionError):
        test_the_engine_and_the_cli_take_the_math_from_the_api(g)
