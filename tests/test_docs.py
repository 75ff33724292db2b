"""The documents of current truth stay short: BENCHMARKS.md's cells and README.md's figures.

* Every table cell of BENCHMARKS.md holds at most ``MAX_CELL_WORDS`` words: one result, its
  target and how it was measured.  Variants, superseded numbers and history belong in
  ``docs/history.md``.  Every row of a table has as many cells as its header (no column lost).
* README.md states no figure (a number with a unit: dB, ms, s, x, GiB, %, images/s ...) outside
  its one status line, which carries the marker ``<!-- status -->``.  Numbers live in
  BENCHMARKS.md.  Inline code (a flag's value such as ``--host-memory 64GiB``) is not a figure.

The files are read as text; nothing is imported.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CELL_WORDS = 40
STATUS_MARKER = "<!-- status -->"

# a number, then a unit; "1.41x" and "2x" but not "1920x1080"
FIGURE = re.compile(
    r"(?<![\w.])\d+(?:[.,]\d+)*\s*"
    r"(?:dB|ms|µs|us|ns|s|sec|min|h|x|×|%|"
    r"[KMGT]i?B|B/Gaussian|images/s|img/s|it/s|steps/s|fps|Hz|GB/s|TB/s)"
    r"(?![\w/])"
)


def split_row(line):
    """The cells of a GFM table row: split on unescaped pipes, outer pipes dropped."""
    cells = re.split(r"(?<!\\)\|", line.strip())
    if cells and cells[0].strip() == "":
        cells = cells[1:]
    if cells and cells[-1].strip() == "":
        cells = cells[:-1]
    return [c.strip() for c in cells]


def tables(text):
    """(line number of the header, header cells, [(line number, cells)]) for every table."""
    lines = text.splitlines()
    found, i, fence = [], 0, False
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            fence = not fence
        if (not fence and lines[i].lstrip().startswith("|") and i + 1 < len(lines)
                and re.fullmatch(r"\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*", lines[i + 1])):
            header, rows, j = split_row(lines[i]), [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append((j + 1, split_row(lines[j])))
                j += 1
            found.append((i + 1, header, rows))
            i = j
            continue
        i += 1
    return found


def count_words(cell):
    """Whitespace-separated tokens holding a letter or a digit ("/", "→" and "|" are not words)."""
    return sum(1 for tok in cell.split() if any(ch.isalnum() for ch in tok))


def long_cells(text, limit=MAX_CELL_WORDS):
    """'line N, column C: W words' for every cell of a table over ``limit`` words."""
    out = []
    for _, header, rows in tables(text):
        for n, cells in rows:
            for col, cell in zip(header, cells):
                words = count_words(cell)
                if words > limit:
                    out.append(f"line {n}, column {col!r}: {words} words: {cell[:80]}...")
    return out


def ragged_rows(text):
    return [f"line {n}: {len(cells)} cells, header has {len(header)}"
            for _, header, rows in tables(text) for n, cells in rows if len(cells) != len(header)]


def figures_outside_status(text):
    """'line N: figure' for every figure of README.md outside its status line and inline code."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if STATUS_MARKER in line:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        out += [f"line {n}: {m.group(0)!r}" for m in FIGURE.finditer(prose)]
    return out


# --------------------------------------------------------------------------- the real files

def test_benchmarks_cells_are_short():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert tables(text), "BENCHMARKS.md has no table"
    long = long_cells(text)
    assert not long, (f"{len(long)} BENCHMARKS.md cells over {MAX_CELL_WORDS} words (one result per cell; "
                      "variants and history go to docs/history.md):\n" + "\n".join(long))


DELIMITER = re.compile(r"\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*")


def headless_tables(text):
    """Line numbers of delimiter rows (``|---|``) with no header row above them: a table the
    other checks cannot see (its cells are read against no header)."""
    lines, fence, found = text.splitlines(), False, []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence and DELIMITER.fullmatch(line) and (i == 0 or not lines[i - 1].lstrip().startswith("|")):
            found.append(i + 1)
    return found


def test_benchmarks_tables_have_headers():
    found = headless_tables((ROOT / "BENCHMARKS.md").read_text())
    assert not found, f"BENCHMARKS.md tables without a header row, delimiters at lines {found}"


def test_benchmarks_rows_keep_their_columns():
    ragged = ragged_rows((ROOT / "BENCHMARKS.md").read_text())
    assert not ragged, "BENCHMARKS.md rows whose cells do not match the header:\n" + "\n".join(ragged)


def test_readme_has_one_status_line():
    text = (ROOT / "README.md").read_text()
    assert sum(STATUS_MARKER in ln for ln in text.splitlines()) == 1, (
        f"README.md must mark exactly one status line with {STATUS_MARKER}")


def test_readme_figures_only_in_status_line():
    found = figures_outside_status((ROOT / "README.md").read_text())
    assert not found, ("README.md states figures outside its status line (numbers go to BENCHMARKS.md):\n"
                       + "\n".join(found))


# --------------------------------------------------------------------------- the checkers themselves

def test_checkers_on_samples():
    table = ("| a | b |\n|---|---:|\n| " + " ".join(["w"] * 41) + " | `x \\| y` |\n"
             "| short | 1 |\n| one cell |\n")
    assert [t[1] for t in tables(table)] == [["a", "b"]]
    assert len(long_cells(table)) == 1 and "41 words" in long_cells(table)[0]
    assert ragged_rows(table) == ["line 5: 1 cells, header has 2"]
    assert tables("```\n| a |\n|---|\n```\n") == []
    assert headless_tables("text\n|---|---|\n| a | b |\n") == [2] and headless_tables(table) == []
    assert count_words("1.40 / 2.91 → 5.84 MB (lego)") == 5

    readme = ("lego reaches 33.5 dB in 30 s, 1.4x faster, 20% less, 64 GiB, 12 images/s\n"
              "1920x1080 images, 7k steps, 3DGS, issue 57, `--host-memory 64GiB`, v2.x\n"
              "<!-- status --> 33 dB, 4 ms\n")
    found = figures_outside_status(readme)
    assert [f.split(": ", 1)[1] for f in found] == ["'33.5 dB'", "'30 s'", "'1.4x'", "'20%'", "'64 GiB'",
                                                    "'12 images/s'"]
