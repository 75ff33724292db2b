"""numbasplat.math.jit: the CPU kernels' Numba caches are dropped when the package's source changed
(Numba checks a cache against its function's own file only)."""
import importlib
import sys

from numbasplat.math.jit import STAMP, drop_stale_caches


def test_caches_written_from_other_sources_are_flushed(tmp_path, monkeypatch):
    """A cached function loads from its cache while the stamp holds the digest it was compiled
    under; under another digest its entries go (it compiles again), once."""
    (tmp_path / "cached_kernels.py").write_text(
        "from types import SimpleNamespace\n"
        "from numba import njit\n"
        "@njit(cache=True)\n"
        "def plus_one(x):\n    return x + 1\n"
        "ops = SimpleNamespace(twice=njit(cache=True)(lambda x: 2 * x))\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def fresh():
        sys.modules.pop("cached_kernels", None)
        m = importlib.import_module("cached_kernels")
        assert m.plus_one(1) == 2 and m.ops.twice(3) == 6
        return m
    try:
        m = fresh()
        assert drop_stale_caches([m], digest="a") == 2  # no stamp yet: flushed, stamped
        assert (tmp_path / "__pycache__" / STAMP).read_text() == "a"
        m = fresh()  # compiles again (the flush emptied the index), saves
        assert sum(m.plus_one.stats.cache_misses.values()) == 1
        assert drop_stale_caches([m], digest="a") == 0  # the same sources: kept
        m = fresh()
        assert sum(m.plus_one.stats.cache_hits.values()) == 1 and not m.plus_one.stats.cache_misses
        assert drop_stale_caches([m], digest="b") == 2  # edited sources: flushed
        m = fresh()
        assert sum(m.plus_one.stats.cache_misses.values()) == 1 and not m.plus_one.stats.cache_hits
    finally:
        sys.modules.pop("cached_kernels", None)
