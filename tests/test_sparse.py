"""comm/sparse.py: the zero-eliding gradient encoding, on the CPU, in the CUDA simulator and as PTX."""
import os

import numpy as np
import pytest

from conftest import REPO_ROOT, run_sim
from comm.sparse import decode_add, encode, scatter_add
from numbasplat.math.sparse import ROWS, message_parts, word_counts

# chunk sizes: empty, single row, not multiples of 32, exactly 32, more than one 256-row segment
COUNTS = [0, 1, 37, 0, 32, 300, 5, 70]


def make_rows(counts, width=12, seed=0, dyadic=False):
    """Random rows with every pattern the encoder must handle, chunk by chunk."""
    rng = np.random.default_rng(seed)
    M = int(np.sum(counts))
    if dyadic:  # small multiples of 1/8: sums are exact in any order (atomics)
        G = rng.integers(-16, 17, (M, width)).astype(np.float32) / 8
    else:
        G = rng.normal(size=(M, width)).astype(np.float32)
    G[rng.random(M) < 0.5] = 0
    single = rng.random(M) < 0.15  # rows with one non-zero field
    G[single] = 0
    G[single, rng.integers(0, width, single.sum())] = 1.5
    starts = np.concatenate([[0], np.cumsum(counts)])
    for d, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        if d % 4 == 1:
            G[a:b] = 0  # all-zero chunk
        elif d % 4 == 2:
            G[a:b, 0] = 0.25  # no zero row
    if M > 3 and not dyadic:
        G[M // 3, 2] = np.nan  # NaN rows are kept
        G[M // 2] = -0.0  # -0.0 counts as zero
    return G


def reference_encode(G, counts):
    keep = np.array([(row != 0).any() for row in G], bool).reshape(-1)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    words = []
    for a, b in zip(starts[:-1], starts[1:]):
        bits = np.zeros(32 * word_counts(b - a), bool)
        bits[:b - a] = keep[a:b]
        words.append(np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32))
    bitmap = np.concatenate(words) if words else np.zeros(0, np.uint32)
    return bitmap, G[keep], np.array([keep[a:b].sum() for a, b in zip(starts[:-1], starts[1:])], np.int64)


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0], [1], [31, 33], [ROWS], [ROWS + 1, 2 * ROWS]])
@pytest.mark.parametrize("seed", [0, 1])
def test_encode_matches_reference(counts, seed):
    G = make_rows(counts, seed=seed)
    message, sizes, kept = encode(G, counts, backend="cpu")
    rb, rp, rk = reference_encode(G, counts)
    assert message.dtype == np.uint32 and kept.dtype == np.int64
    np.testing.assert_array_equal(kept, rk)
    segments = (np.asarray(counts) + ROWS - 1) // ROWS
    np.testing.assert_array_equal(sizes, word_counts(counts) + segments + 12 * rk)
    assert message.size == sizes.sum()
    bitmap, bases, packed = message_parts(message, counts, kept, 12)
    np.testing.assert_array_equal(bitmap, rb)
    np.testing.assert_array_equal(packed, rp)  # NaNs compare equal here
    keep = np.array([(row != 0).any() for row in G], bool)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    want = [keep[a:a + s].sum() for a, b in zip(starts[:-1], starts[1:]) for s in range(0, b - a, ROWS)]
    np.testing.assert_array_equal(bases, want)  # kept rows of the chunk before each segment


def test_float64_rows_travel_as_two_words():
    G = make_rows(COUNTS, seed=4).astype(np.float64)
    message, sizes, kept = encode(G, COUNTS, backend="cpu")
    np.testing.assert_array_equal(message_parts(message, COUNTS, kept, 12, np.float64)[2], G[(G != 0).any(1)])
    out = np.zeros((len(G), 12))
    decode_add(message, COUNTS, kept, np.arange(len(G), dtype=np.int32), out, backend="cpu")
    np.testing.assert_array_equal(out, np.where(G == 0, 0, G))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_add_matches_add_at(seed):
    rng = np.random.default_rng(seed)
    G = make_rows(COUNTS, seed=seed)
    route = rng.integers(0, 9, len(G)).astype(np.int32)  # many rows share an output row
    out = rng.normal(size=(9, 12)).astype(np.float32)
    ref = out.copy()
    np.add.at(ref, route, G)
    message, _, kept = encode(G, COUNTS, backend="cpu")
    decode_add(message, COUNTS, kept, route, out, backend="cpu")
    np.testing.assert_array_equal(out, ref)
    dense = out.copy()
    scatter_add(G, route, dense, backend="cpu")
    np.add.at(ref, route, G)
    np.testing.assert_array_equal(dense, ref)


def test_roundtrip_and_shapes():
    G = make_rows(COUNTS, seed=3)
    message, sizes, kept = encode(G, COUNTS, backend="cpu")
    out = np.zeros_like(G)
    decode_add(message, COUNTS, kept, np.arange(len(G), dtype=np.int32), out, backend="cpu")
    np.testing.assert_array_equal(out, np.where(G == 0, 0, G))
    assert message_parts(message, COUNTS, kept, 12)[2].shape == (kept.sum(), 12)
    message, sizes, kept = encode(np.zeros((0, 4), np.float32), [0, 0], backend="cpu")
    assert message.size == 0 and sizes.tolist() == [0, 0] and kept.tolist() == [0, 0]


def test_bad_arguments_raise():
    G = make_rows([40, 3])
    with pytest.raises(ValueError):
        encode(G, [40, 2], backend="cpu")
    message, sizes, kept = encode(G, [40, 3], backend="cpu")
    out = np.zeros((4, 12), np.float32)
    route = np.zeros(43, np.int32)
    with pytest.raises(ValueError):
        decode_add(message, [70, 3], kept, np.zeros(73, np.int32), out, backend="cpu")  # message too short
    with pytest.raises(ValueError):
        decode_add(message, [40, 3], kept, np.zeros(44, np.int32), out, backend="cpu")  # route too long
    with pytest.raises(ValueError):
        short = np.delete(message, np.arange(sizes[0] - 12, sizes[0]))  # chunk 0 without its last row
        decode_add(short, [40, 3], kept - [1, 0], route, out, backend="cpu")  # its bitmap sets a missing row
    with pytest.raises(ValueError):
        decode_add(message, [40, 3], kept, route, np.zeros((4, 10), np.float32), backend="cpu")


@pytest.mark.sim
@pytest.mark.timeout(600)
def test_cuda_kernels_match_cpu_in_simulator():
    run_sim(f"""
        import sys
        sys.path.insert(0, {str(REPO_ROOT / "tests")!r})
        import numpy as np
        from test_sparse import make_rows
        from comm.sparse import encode, decode_add, scatter_add
        rng = np.random.default_rng(5)
        for counts, dyadic in (({COUNTS!r}, False), ([0, 3, 0], True), ([], True)):
            G = make_rows(counts, seed=7, dyadic=dyadic)
            cpu = encode(G, counts, backend="cpu")
            gpu = encode(G, counts, backend="cuda")
            for a, b in zip(cpu, gpu):
                assert a.dtype == b.dtype, (a.dtype, b.dtype)
                np.testing.assert_array_equal(a, b)  # the same words, NaN rows included
            if not dyadic:
                continue
            route = rng.integers(0, 5, len(G)).astype(np.int32)
            base = (rng.integers(-8, 8, (5, 12)) / 4).astype(np.float32)
            outs = [base.copy() for _ in range(4)]
            decode_add(cpu[0], counts, cpu[2], route, outs[0], backend="cpu")
            decode_add(gpu[0], counts, gpu[2], route, outs[1], backend="cuda")
            scatter_add(G, route, outs[2], backend="cpu")
            scatter_add(G, route.astype(np.int64), outs[3], backend="cuda")  # converted to int32
            ref = base.copy()
            np.add.at(ref, route, G)
            for o in outs:
                np.testing.assert_array_equal(o, ref)
        G = make_rows({COUNTS!r}, seed=8, dyadic=True)
        route = rng.integers(0, 7, len(G)).astype(np.int32)
        a, b = np.zeros((7, 12), np.float32), np.zeros((7, 12), np.float32)
        message, _, kept = encode(G, {COUNTS!r}, backend="cuda")
        decode_add(message, {COUNTS!r}, kept, route, a, backend="cuda")
        np.add.at(b, route, G)
        np.testing.assert_array_equal(a, b)
        print("comm kernels ok")
    """, timeout=600)


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="simulator has no compiler")
def test_sparse_kernels_compile_to_ptx(monkeypatch):
    """The simulator catches no typing errors: compile the real kernels (needs NVVM, no GPU)."""
    from numba import cuda as numba_cuda
    try:
        numba_cuda.compile_ptx(lambda a: None, "void(float32[::1])", cc=(9, 0))
    except Exception:
        pytest.skip("no NVVM (install numba-cuda[cu12])")
    from types import SimpleNamespace

    from numba.cuda import dispatcher
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))
    from numbasplat.cuda import launch, sparse  # noqa: F401  (registers the kernels)
    names = [n for n in launch.KERNELS if n.startswith("numbasplat.cuda.sparse.")]
    assert len(names) == 4, names
    for name in names:
        fn, sig = launch.KERNELS[name]
        ptx, _ = numba_cuda.compile_ptx(fn, sig, cc=(9, 0))
        assert ".entry" in ptx, name
