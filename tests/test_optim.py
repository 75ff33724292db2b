"""Fused Adam against a plain numpy Adam, per group and with the visible-only option."""
import numpy as np
import pytest

from conftest import run_sim
from numbasplat.optim import Adam, FlatParams, RowsAdam, adam_step_bound, column_lrs, exp_decay
from numbasplat.rows import row_normals
from tests.scenes import edge_case_scene

LR = {"means": 1e-3, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}


def numpy_adam(x, grads_seq, lr_cols, widths, visible_seq, b1=0.9, b2=0.999, eps=1e-15):
    """Reference: explicit per-group loops over 2D views."""
    x = {k: a.astype(np.float64).reshape(a.shape[0], -1).copy() for k, a in x.items()}
    m = {k: np.zeros_like(a) for k, a in x.items()}
    v = {k: np.zeros_like(a) for k, a in x.items()}
    col = 0
    offsets = {}
    for k in ("means", "scales", "quats", "opacities", "sh"):
        offsets[k] = col
        col += widths[k]
    for t, (grads, vis) in enumerate(zip(grads_seq, visible_seq), 1):
        for k in x:
            gr = grads[k].reshape(x[k].shape[0], -1)
            rows = np.ones(len(gr), bool) if vis is None else vis
            lr = lr_cols[offsets[k]:offsets[k] + widths[k]]
            m[k][rows] = b1 * m[k][rows] + (1 - b1) * gr[rows]
            v[k][rows] = b2 * v[k][rows] + (1 - b2) * gr[rows] ** 2
            x[k][rows] -= lr * (m[k][rows] / (1 - b1**t)) / (np.sqrt(v[k][rows] / (1 - b2**t)) + eps)
    return x


@pytest.mark.parametrize("visible_only", [False, True])
def test_fused_adam_matches_numpy(visible_only):
    g = edge_case_scene(n=17, dtype=np.float32)
    flat = FlatParams.from_gaussians(g)
    start = {k: a.copy() for k, a in g.arrays().items()}
    opt = Adam(flat, backend="cpu")
    lrs = column_lrs(LR, flat.sh_bases)
    rng = np.random.default_rng(0)
    grads_seq, vis_seq = [], []
    for _ in range(4):
        gflat = flat.like(rng.normal(size=flat.size).astype(np.float32))
        vis = rng.random(flat.n) < 0.6 if visible_only else None
        opt.step(gflat.data, lrs, vis)
        grads_seq.append({k: a.copy() for k, a in gflat.gaussians().arrays().items()})
        vis_seq.append(vis)
    ref = numpy_adam(start, grads_seq, lrs, flat.widths, vis_seq)
    for k, a in flat.gaussians().arrays().items():
        np.testing.assert_allclose(a.reshape(ref[k].shape), ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    if visible_only:
        never = ~np.any(vis_seq, axis=0)
        assert never.any()
        np.testing.assert_array_equal(flat.view("means")[never], start["means"][never])


def test_adam_skip_flag_leaves_the_state():
    """A set skip flag (a device flag on GPUs) leaves parameters and moments as they are."""
    g = edge_case_scene(n=9, dtype=np.float32)
    flat = FlatParams.from_gaussians(g)
    opt = Adam(flat, backend="cpu")
    lrs = column_lrs(LR, flat.sh_bases)
    grads = np.random.default_rng(1).normal(size=flat.size).astype(np.float32)
    opt.step(grads, lrs)
    state = [a.copy() for a in (flat.data, opt.m, opt.v)]
    opt.step(grads, lrs, skip=np.ones(1, np.int32))
    for a, b in zip(state, (flat.data, opt.m, opt.v)):
        np.testing.assert_array_equal(a, b)
    opt.step(grads, lrs, skip=np.zeros(1, np.int32))
    assert not np.array_equal(state[0], flat.data)


def test_adam_with_its_moments_in_table_rows_steps_as_the_flat_one():
    """``RowsAdam``: the parameters and moments of Gaussian k in row ``rows[k]`` of a row table (parameters,
    m, v from columns 2, 2 + w, 2 + 2w, in ``FlatParams``' column order) step as the flat ``Adam`` does, bit
    for bit, visible-only and with a skipped step; the new parameters land in the flat buffer and the
    table; the table's other rows and columns are left alone."""
    g = edge_case_scene(n=13, dtype=np.float32)
    flat, mine = FlatParams.from_gaussians(g), FlatParams.from_gaussians(g)
    n, w = flat.n, flat.size // flat.n
    rng = np.random.default_rng(2)
    rows = rng.permutation(n + 5)[:n]
    table = rng.normal(size=(n + 5, 2 + 3 * w + 1)).astype(np.float32)
    table[rows, 2:2 + w] = np.concatenate([flat.view(k).reshape(n, -1) for k in
                                           ("means", "scales", "quats", "opacities", "sh")], axis=1)
    table[rows, 2 + w:2 + 3 * w] = 0
    untouched = table.copy()
    reference, in_rows = Adam(flat, backend="cpu"), RowsAdam(mine, backend="cpu", table=table, rows=rows,
                                                              columns=(2, 2 + w, 2 + 2 * w))
    assert in_rows.m.size == in_rows.v.size == 0
    lrs = column_lrs(LR, flat.sh_bases)
    for k, vis in enumerate((None, rng.random(n) < 0.5, rng.random(n) < 0.5)):
        grads = rng.normal(size=flat.size).astype(np.float32)
        skip = np.array([k == 2], np.int32)
        reference.step(grads, lrs, vis, skip)
        in_rows.step(grads, lrs, vis, skip)
    np.testing.assert_array_equal(mine.data, flat.data)
    as_rows = lambda buffer: np.concatenate([flat.like(buffer).view(k).reshape(n, -1) for k in  # noqa: E731
                                             ("means", "scales", "quats", "opacities", "sh")], axis=1)
    for part, buffer in enumerate((flat.data, reference.m, reference.v)):
        np.testing.assert_array_equal(table[rows, 2 + part * w:2 + (part + 1) * w], as_rows(buffer))
    others = np.setdiff1d(np.arange(n + 5), rows)
    np.testing.assert_array_equal(table[others], untouched[others])
    np.testing.assert_array_equal(table[:, [0, 1, -1]], untouched[:, [0, 1, -1]])


def test_adam_reading_parameters_from_table_rows_steps_as_rows_adam():
    """``adam_table_rows`` (the host's Adam of a working set) reads the parameters from the table, not from the
    flat buffer (garbage here: the device wrote gradients over its copy), and writes every Gaussian's to the
    flat buffer, stepped or not: bit for bit ``adam_rows`` on a flat buffer read from the table, over visible-only
    steps with uneven groups (SH degree 3) and permuted rows."""
    from numbasplat.cpu import adam_rows, adam_table_rows
    g = edge_case_scene(n=11, dtype=np.float32)
    flat = FlatParams.from_gaussians(g)
    n, w = flat.n, flat.size // flat.n
    rng = np.random.default_rng(4)
    rows = rng.permutation(n + 3)[:n]
    table = rng.normal(size=(n + 3, 1 + 3 * w)).astype(np.float32)
    table[:, 1 + 2 * w:] = np.abs(table[:, 1 + 2 * w:])
    lrs = column_lrs(LR, flat.sh_bases)
    layout = flat.layout(lrs)
    columns = np.array([1, 1 + w, 1 + 2 * w], np.int32)
    expected, mine = table.copy(), table.copy()
    for step, vis in enumerate((rng.random(n) < 0.5, rng.random(n) < 0.5, np.ones(n, bool))):
        grads = rng.normal(size=flat.size).astype(np.float32)
        args = (grads, *layout, lrs, vis, True, np.zeros(1, np.int32), np.float32(0.9), np.float32(0.999),
                np.float32(1e-15), np.array([1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1)], np.float32))
        reference = np.concatenate([expected[rows, 1 + c:1 + c + width].reshape(-1)  # (FlatParams' order)
                                    for width, c in zip(layout[1], layout[2])])
        adam_rows(expected, rows, columns, reference, *args)
        params = np.full(flat.size, np.nan, np.float32)
        adam_table_rows(mine, rows, columns, params, *args)
        np.testing.assert_array_equal(mine, expected)
        np.testing.assert_array_equal(params, reference)


def test_adam_step_bound_holds_and_is_reached():
    """The fused Adam's steps (visible-only, rows skipping steps) never move a parameter by more than
    ``adam_step_bound`` learning rates; gradients growing by b2 / b1 a step (where Cauchy-Schwarz is
    tight) come within 2% of it once the bias corrections have faded; random ones stay far under."""
    bound = adam_step_bound()
    assert bound == pytest.approx(7.27, abs=0.01)
    t = np.arange(1, 200_000)
    assert (np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t) <= 1 + 1e-12).all()  # the bias corrections' ratio
    with pytest.raises(ValueError, match="b1"):
        adam_step_bound(0.99, 0.9)
    g = edge_case_scene(n=8, dtype=np.float32)
    flat = FlatParams.from_gaussians(g)
    opt = Adam(flat, backend="cpu")
    opt.step_count = 50_000  # the bias corrections faded
    lrs = np.full(len(column_lrs(LR, flat.sh_bases)), 1e-3, np.float32)
    rng = np.random.default_rng(2)
    worst = 0.0
    for k in range(300):
        before = flat.data.copy()
        grads = np.zeros(flat.size, np.float32)
        grads[: flat.n * 3] = (0.999 / 0.9) ** k   # the means (group first): growing gradients
        grads[flat.n * 3:] = rng.normal(size=flat.size - flat.n * 3)
        vis = rng.random(flat.n) < 0.8 if k % 2 else None  # rows skip steps
        opt.step(grads, lrs, vis)
        moved = np.abs(flat.data.astype(np.float64) - before) / 1e-3
        assert moved.max() <= bound * (1 + 1e-5), (k, moved.max())
        worst = max(worst, moved[: flat.n * 3].max())
    assert worst > 0.98 * bound, worst  # the bound is reached: no loose guess


def test_sh_columns_get_band_rates_and_means_decay():
    lrs = column_lrs(LR, 16)
    assert lrs.size == 3 + 3 + 4 + 1 + 48
    np.testing.assert_allclose(lrs[11:14], 2.5e-3)
    np.testing.assert_allclose(lrs[14:], 2.5e-3 / 20)
    assert exp_decay(1.6e-4, 1.6e-6, 0, 100) == pytest.approx(1.6e-4)
    assert exp_decay(1.6e-4, 1.6e-6, 50, 100) == pytest.approx(1.6e-5)
    assert exp_decay(1.6e-4, 1.6e-6, 100, 100) == pytest.approx(1.6e-6)


@pytest.mark.sim
@pytest.mark.timeout(600)
def test_cuda_adam_matches_cpu_in_simulator():
    run_sim("""
        import numpy as np
        from numbasplat.optim import Adam, FlatParams, column_lrs
        from tests.scenes import edge_case_scene
        LR = {"means": 1e-3, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}
        g = edge_case_scene(n=40, dtype=np.float32)  # 2360 elements: several blocks, the last partial
        a, b = FlatParams.from_gaussians(g), FlatParams.from_gaussians(g)
        oa, ob = Adam(a, backend="cpu"), Adam(b, backend="cuda")
        rng = np.random.default_rng(1)
        lrs = column_lrs(LR, a.sh_bases)
        for vis in (None, rng.random(40) < 0.5):
            gr = rng.normal(size=a.size).astype(np.float32)
            oa.step(gr, lrs, vis)
            ob.step(gr, lrs, vis)
        np.testing.assert_allclose(b.data, a.data, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(ob.m, oa.m, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(ob.v, oa.v, rtol=1e-6, atol=1e-12)
        print("adam ok")
    """)


def test_row_normals_are_standard_normal():
    """300k draws: mean, spread, the one- and two-sigma masses and the tails of N(0, 1); columns and
    neighbouring rows uncorrelated; another key, other draws."""
    z = row_normals(7, np.arange(100_000), 3)
    assert z.shape == (100_000, 3) and z.dtype == np.float32 and np.isfinite(z).all()
    flat = z.astype(np.float64).ravel()
    assert abs(flat.mean()) < 0.01 and abs(flat.std() - 1) < 0.01
    assert abs((np.abs(flat) < 1).mean() - 0.6827) < 0.005 and abs((np.abs(flat) < 2).mean() - 0.9545) < 0.003
    assert 2e-4 < (np.abs(flat) > 3.5).mean() < 7e-4  # 4.65e-4 expected
    assert abs(np.corrcoef(z[:, 0], z[:, 1])[0, 1]) < 0.01 and abs(np.corrcoef(z[:-1, 0], z[1:, 0])[0, 1]) < 0.01
    other = row_normals(8, np.arange(100_000), 3)
    assert abs(np.corrcoef(z.ravel(), other.ravel())[0, 1]) < 0.01


def test_row_normals_follow_the_global_row_whatever_the_sharding():
    """A row's draws are those of its global row: contiguous shards (offsets) and index-parity
    shards (offset the rank, stride the rank count) draw exactly what one process holding every
    row draws, and a subset of rows (the split Gaussians) draws their rows' values."""
    n, key = 1001, 2**63 - 1
    whole = row_normals(key, np.arange(n), 6)
    assert np.array_equal(np.concatenate([row_normals(key, np.arange(k), 6, offset=o)
                                          for o, k in ((0, 400), (400, 601))]), whole)
    for ranks in (2, 3):
        for r in range(ranks):
            local = np.arange(len(range(r, n, ranks)))
            assert np.array_equal(row_normals(key, local, 6, offset=r, stride=ranks), whole[r::ranks])
    some = np.array([5, 17, 999])
    assert np.array_equal(row_normals(key, some, 6), whole[some])
    assert row_normals(key, np.zeros(0, np.int64), 6).shape == (0, 6)
