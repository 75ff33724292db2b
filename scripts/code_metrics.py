"""The structure figures of issue 59's aesthetics row: the refusal sites of pipeline options, the
``getattr(a, ...)`` reads in cli/, engine's longest functions, its mixins, and the documents' sizes.

    python scripts/code_metrics.py

A refusal site is a function outside ``engine/pipelines/options.py`` that raises ValueError on an
option of ``PipelineOptions``; a mixin, a class with more than one base of the project's own.
"""
import ast
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def main():
    from engine.pipelines.options import PipelineOptions
    options = {f.name for f in dataclasses.fields(PipelineOptions)}
    engine = sorted((ROOT / "engine").rglob("*.py"))
    lengths, sites, mixins = [], set(), []
    own_classes = set()
    trees = {p: ast.parse(p.read_text()) for p in engine}
    for tree in trees.values():
        own_classes |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for path, tree in trees.items():
        rel = path.relative_to(ROOT)
        for f in functions(tree):
            lengths.append((f.end_lineno - f.lineno + 1, f"{rel}:{f.name}"))
            if rel.as_posix() == "engine/pipelines/options.py":
                continue
            for node in ast.walk(f):
                if isinstance(node, ast.Raise) and "ValueError" in ast.unparse(node)[:40]:
                    text = ast.unparse(node)
                    if any(re.search(rf"\b{o}\b|--{o.replace('_', '-')}\b", text) for o in options):
                        sites.add(f"{rel}:{f.name}")
        for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = [ast.unparse(b) for b in c.bases]
            if sum(b.split(".")[-1] in own_classes for b in bases) > 1:
                mixins.append(f"{rel}:{c.name}({', '.join(bases)})")
    getattrs = sum(len(re.findall(r"getattr\(a\b", p.read_text())) for p in (ROOT / "cli").glob("*.py"))
    lengths.sort(reverse=True)
    print(f"refusal sites outside check: {len(sites)} {sorted(sites)}")
    print(f"getattr(a, ...) in cli/: {getattrs}")
    print("longest engine functions: " + ", ".join(f"{n} {name}" for n, name in lengths[:3]))
    print(f"mixins: {len(mixins)} {mixins}")
    for doc in ("README.md", "BENCHMARKS.md"):
        text = (ROOT / doc).read_text()
        print(f"{doc}: {text.count(chr(10))} lines, {len(text.encode()) / 1000:.0f} KB")


if __name__ == "__main__":
    main()
