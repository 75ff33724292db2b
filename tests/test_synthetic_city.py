"""data/synthetic_city.py, the procedural city benchmark: its layout and cameras
(street views in the streets, aerial ones above the roofs, far views seeing
disjoint parts), the exact Gaussian budget, the dataset it writes (loaded by
data.load_dataset: views, split, intrinsics, poses, and images the ground-truth
PLY renders back), determinism, bad input, and a CPU smoke test of
``run.py synth`` followed by ``run.py train``."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import numbasplat as ns
import cli
from data import load_dataset
from data import synthetic_city as sc
from data.ply import load_ply

REPO = Path(__file__).resolve().parents[1]
TINY = dict(preset="small", gaussians=20_000, views=17, resolution="64x36")   # test views 0, 8 (street), 16 (aerial)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("city") / "tiny"
    summary = sc.generate(out, seed=3, progress=False, backend="cpu", **TINY)
    return out, summary


@pytest.fixture(scope="module")
def small_layout():
    return sc.plan_city(sc.PRESETS["small"].blocks, seed=0)


def _inside(points, boxes, margin=0.0):
    """(P,) whether each point lies inside any of the boxes (x0, y0, z0, x1, y1, z1) grown by ``margin``."""
    p = np.asarray(points)[:, None, :]
    return ((p >= boxes[None, :, :3] - margin) & (p <= boxes[None, :, 3:] + margin)).all(2).any(1)


def _block_rects(layout):
    s = layout.streets[:-1] + sc.ROAD / 2
    x0, y0 = np.meshgrid(s, s, indexing="ij")
    return np.stack([x0.ravel(), y0.ravel(), x0.ravel() + sc.BLOCK, y0.ravel() + sc.BLOCK], 1)


def _in_rects(xy, rects):
    xy = np.asarray(xy)[:, None, :]
    return ((xy >= rects[None, :, :2]) & (xy <= rects[None, :, 2:])).all(2).any(1)


def test_buildings_stand_in_blocks_cars_in_the_road_trees_on_sidewalks(small_layout):
    lay = small_layout
    inner = _block_rects(lay) + (sc.SIDEWALK, sc.SIDEWALK, -sc.SIDEWALK, -sc.SIDEWALK)
    b = lay.buildings
    assert len(b) > 2 * lay.blocks ** 2
    assert _in_rects(b[:, :2], inner).all() and _in_rects(b[:, 3:5], inner).all()
    assert (b[:, 5] > b[:, 2]).all() and len(np.unique(b[:, 5])) > 10   # heights vary
    towers = b[b[:, 2] > 0]
    assert len(towers) and all(_inside(t[None, :3] + (0.1, 0.1, -0.1), b[b[:, 2] == 0]).all() for t in towers)
    cars = lay.cars
    assert len(cars) > 50
    assert not _in_rects(cars[:, :2], _block_rects(lay)).any() and not _in_rects(cars[:, 3:5], _block_rects(lay)).any()
    trees = lay.trees[:, :2]
    on_sidewalk = _in_rects(trees, _block_rects(lay)) & ~_in_rects(trees, inner)
    in_park = _in_rects(trees, inner)
    assert (on_sidewalk | in_park).all() and on_sidewalk.sum() > 100
    assert not _inside(np.column_stack([trees, np.ones(len(trees))]), b).any()


def test_street_cameras_stay_in_the_streets_and_aerial_ones_above_the_roofs(small_layout):
    lay = small_layout
    views = sc.city_views(lay, 300, 96, 54)
    assert [v.kind for v in views] == ["street"] * 210 + ["aerial"] * 90
    pos = np.array([v.position for v in views])
    street, aerial = pos[:210], pos[210:]
    # on the road: within LANE of a street centreline, never inside a block
    d = np.abs(street[:, :2, None] - lay.streets[None, None, :]).min(2)
    assert (d.min(1) <= sc.LANE + 1e-9).all()
    assert not _in_rects(street[:, :2], _block_rects(lay)).any()
    assert (np.abs(street[:, :2]) < lay.half).all()
    assert ((street[:, 2] >= 1.6) & (street[:, 2] <= 3.0)).all()
    boxes = np.concatenate([lay.buildings, lay.cars, lay.car_cabins()])
    assert not _inside(street, boxes, margin=1.0).any()
    crown = np.column_stack([lay.trees[:, :2], lay.trees[:, 2] + 0.7 * lay.trees[:, 3]])
    gap = np.linalg.norm(street[:, None] - crown[None], axis=2) - lay.trees[None, :, 3]
    assert gap.min() > 1.0
    # street views look along the street (forward's horizontal part within 30 degrees of an axis) and level-ish
    fwd = np.array([v.camera.viewmat[2, :3] for v in views])
    yaw = np.degrees(np.arctan2(fwd[:210, 1], fwd[:210, 0])) % 90
    assert (np.minimum(yaw, 90 - yaw) <= 30 + 1e-6).all()
    assert ((fwd[:210, 2] >= -1e-9) & (fwd[:210, 2] <= np.sin(np.radians(10)) + 1e-9)).all()
    # aerial: above the tallest building, looking down at the city
    assert (aerial[:, 2] > 1.15 * lay.tallest).all()
    assert (fwd[210:, 2] < -0.5).all()
    # the walks and orbits cover the city rather than one corner
    assert np.ptp(street[:, 0]) > 2 * sc.PITCH and np.ptp(street[:, 1]) > 2 * sc.PITCH
    assert np.ptp(aerial[:, 0]) > 2 * sc.PITCH and np.ptp(aerial[:, 1]) > 2 * sc.PITCH


def _working_set(frame):
    """The Gaussians a render processed before its pixels turned opaque: per tile, the depth-sorted
    list up to the furthest ``last`` of its pixels (so occluded Gaussians are not counted)."""
    last = frame.render.last
    H, W = last.shape
    tx, ty = frame.projection.camera.tiles
    t = W // tx
    assert (t * tx, t * ty) == (W, H), "use an image size of whole tiles"
    pad = np.zeros((ty * t, tx * t), np.int64)
    pad[:H, :W] = last
    stop = pad.reshape(ty, t, tx, t).max((1, 3)).ravel()
    ranges = frame.binning.ranges
    stop = np.maximum(stop, ranges[:, 0])
    ids = frame.binning.ids
    return np.unique(np.concatenate([ids[a:b] for a, b in zip(ranges[:, 0], stop)] + [np.zeros(0, ids.dtype)]))


def test_far_apart_street_views_see_disjoint_parts_of_the_city(small_layout):
    """Street views two blocks apart on different streets share almost none of the Gaussians
    their renders process (Jaccard index of the working sets, the sky left out: every view
    sees it), while consecutive views of a walk share much: the buildings occlude."""
    lay = small_layout
    model = sc.city_gaussians(lay, 100_000)
    city_end = model.parts["sky"][0]
    views = [v for v in sc.city_views(lay, 80, 128, 64) if v.kind == "street"]
    sets = []
    for v in views:
        s = _working_set(ns.render(model.gaussians, v.camera, background=sc.BACKGROUND, backend="cpu"))
        sets.append(s[s < city_end])
    pos = np.array([v.position for v in views])
    far, near = [], []
    for a in range(len(views)):
        for b in range(a + 1, len(views)):
            shared = len(np.intersect1d(sets[a], sets[b])) / len(np.union1d(sets[a], sets[b]))
            dx, dy = np.abs(pos[a, :2] - pos[b, :2])
            if min(dx, dy) > 2 * sc.PITCH:
                far.append(shared)
            elif b == a + 1 and np.hypot(dx, dy) < 2 * sc.PATH_STEP:
                near.append(shared)
    far, near = np.array(far), np.array(near)
    assert len(far) > 50 and len(near) > 40
    assert np.median(far) < 0.05 and (far < 0.1).mean() > 0.75, (np.median(far), (far < 0.1).mean())
    assert np.median(near) > 0.3, np.median(near)


@pytest.mark.parametrize("n", [5_000, 123_457, 400_000])
def test_gaussian_budget_is_exact_and_the_parts_are_what_they_say(small_layout, n):
    lay = small_layout
    model = sc.city_gaussians(lay, n)
    g = model.gaussians
    assert len(g) == n and g.sh.shape == (n, (sc.SH_DEGREE + 1) ** 2, 3)
    assert g.means.dtype == np.float32 and np.isfinite(g.means).all() and np.isfinite(g.sh).all()
    edges = [model.parts[p] for p in sc.PARTS]
    assert edges[0][0] == 0 and edges[-1][1] == n and all(a[1] == b[0] for a, b in zip(edges, edges[1:]))
    assert all(b > a for a, b in edges)
    a, b = model.parts["buildings"][0], model.parts["fields"][1]
    s = np.exp(g.scales[a:b])
    assert (s.min(1) < 0.1 * s.max(1)).all()                      # flat surface Gaussians
    assert (1 / (1 + np.exp(-g.opacities[a:b])) > 0.99).all()     # opaque
    a, b = model.parts["sky"]
    r = np.linalg.norm(g.means[a:b], axis=1)
    assert np.allclose(r, lay.dome_radius, rtol=1e-5) and lay.dome_radius > 1.4 * sc.FIELD_REACH * lay.half
    a, b = model.parts["buildings"]
    assert np.abs(g.sh[a:b, 2]).max() > 0 and not g.sh[model.parts["ground"][0]:, 1:].any()  # only glass has a sheen


def test_no_gaussian_hides_inside_a_building(small_layout):
    """The ground under a building and the roof under a tower are cut out: no budget is spent
    on Gaussians that no view can see."""
    lay = small_layout
    model = sc.city_gaussians(lay, 200_000)
    means = model.gaussians.means
    walls_out = lay.buildings + (1e-3, 1e-3, 0.0, -1e-3, -1e-3, 0.0)   # (the walls' own Gaussians are on them)
    for part in ("buildings", "cars", "ground", "trees"):
        a, b = model.parts[part]
        lifted = means[a:b].astype(np.float64) + (0.0, 0.0, 1e-2)   # ground and roofs: in what stands on them
        assert not _inside(lifted, walls_out).any(), part


def test_chunking_does_not_change_the_gaussians(small_layout, monkeypatch):
    whole = sc.city_gaussians(small_layout, 30_000).gaussians
    monkeypatch.setattr(sc, "CHUNK", 997)
    chunked = sc.city_gaussians(small_layout, 30_000).gaussians
    for k, v in whole.arrays().items():
        np.testing.assert_array_equal(v, getattr(chunked, k), err_msg=k)


def test_too_few_gaussians_names_the_option(small_layout, tmp_path):
    with pytest.raises(ValueError, match=r"--gaussians 100 is too few .* at least \d+"):
        sc.generate(tmp_path / "x", gaussians=100, views=2, resolution="32x18", progress=False)
    assert not (tmp_path / "x").exists()   # checked before anything is written


def test_an_aerial_capture_of_a_larger_city(tmp_path):
    """--street-share 0: aerial orbits only; --blocks: the city's size (its streets and the views'
    reach follow); a share outside [0, 1] is refused naming the option."""
    summary = sc.generate(tmp_path / "aerial", gaussians=20_000, views=5, resolution="32x18", progress=False,
                          backend="cpu", blocks=7, street_share=0.0)
    assert summary["street_views"] == 0 and summary["aerial_views"] == 5 and summary["blocks"] == 7
    assert len(sc.plan_city(7, 0).streets) == len(sc.plan_city(5, 0).streets) + 2
    assert sorted(p.name for p in (tmp_path / "aerial" / "images").iterdir())[0].endswith("_aerial.png")
    with pytest.raises(ValueError, match="--street-share"):
        sc.generate(tmp_path / "bad", gaussians=20_000, views=5, resolution="32x18", progress=False, street_share=1.5)


def test_generated_dataset_loads_with_its_cameras_split_and_images(tiny):
    out, summary = tiny
    views = sc.city_views(sc.plan_city(sc.PRESETS["small"].blocks, 3), 17, 64, 36)
    ds = load_dataset(out, test_every=8)
    assert ds.fmt == "colmap" and len(ds.train) + len(ds.test) == 17
    # every 8th captured view is held out, street and aerial ones alike
    assert [v.name for v in ds.test] == [views[i].name for i in (0, 8, 16)]
    assert [v.name for v in ds.train] == [v.name for i, v in enumerate(views) if i % 8]
    assert summary["test_views"] == 3 and {views[i].kind for i in (0, 8, 16)} == {"street", "aerial"}
    fx, fy, cx, cy = sc.intrinsics(64, 36)
    by_name = {v.name: v for v in views}
    for v in ds.views:
        ref = by_name[v.name].camera
        assert (v.camera.width, v.camera.height) == (64, 36) and v.image.shape == (36, 64, 3)
        assert (v.camera.fx, v.camera.fy, v.camera.cx, v.camera.cy) == (fx, fy, cx, cy)
        np.testing.assert_array_equal(v.camera.viewmat, ref.viewmat)
    # the initial points: a noisy sample of the city's surfaces in their colours
    assert len(ds.points) == summary["initial_points"] > 100
    lay = sc.plan_city(sc.PRESETS["small"].blocks, 3)
    assert (np.abs(ds.points[:, :2]) < lay.half + 1).all() and (ds.points[:, 2] > -1).all()
    assert (ds.points[:, 2] < lay.tallest + 1).all() and ds.colors.std() > 0.05
    # the ground-truth PLY renders each written image back, to 8-bit rounding
    gt = ns.Gaussians(**load_ply(out / "ground_truth.ply"))
    assert len(gt) == 20_000 and gt.sh_degree() == sc.SH_DEGREE
    for v in ds.test + ds.train[:3]:
        frame = ns.render(gt, v.camera, background=sc.BACKGROUND, backend="cpu")
        err = np.abs(np.clip(frame.image, 0, 1) - v.image).max()
        assert err <= 0.5 / 255 + 1e-6, (v.name, err * 255)


def test_a_ground_truth_of_a_higher_sh_degree_holds_the_same_colours_and_zeros_above():
    """``--sh-degree 3``: the same Gaussians, their degree-1 colours, the higher bands zero (rows as wide as a model
    trained at degree 3)."""
    layout = sc.plan_city(2, 5)
    low, high = sc.city_gaussians(layout, 3000), sc.city_gaussians(layout, 3000, sh_degree=3)
    assert low.gaussians.sh_degree() == sc.SH_DEGREE == 1 and high.gaussians.sh_degree() == 3
    for k, a in low.gaussians.arrays().items():
        b = getattr(high.gaussians, k)
        np.testing.assert_array_equal(b[:, :4] if k == "sh" else b, a, err_msg=k)
    assert not high.gaussians.sh[:, 4:].any() and high.gaussians.sh[:, 1:4].any()
    with pytest.raises(ValueError, match="--sh-degree"):
        sc.generate("unused", gaussians=3000, sh_degree=4)


def test_generation_is_deterministic_in_the_seed(tiny, tmp_path):
    out, _ = tiny
    again = tmp_path / "again"
    sc.generate(again, seed=3, progress=False, backend="cpu", **TINY)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert len(files) == 17 + 5
    for f in files:
        assert (out / f).read_bytes() == (again / f).read_bytes(), f
    other = tmp_path / "other"
    sc.generate(other, seed=4, progress=False, backend="cpu", **TINY)
    for f in ("ground_truth.ply", "sparse/0/images.txt", "sparse/0/points3D.txt", "images/00000_street.png"):
        assert (out / f).read_bytes() != (other / f).read_bytes(), f


def test_exposure_scales_the_training_images_and_leaves_the_held_out_ones(tiny, tmp_path):
    out, _ = tiny
    varied = tmp_path / "varied"
    sc.generate(varied, seed=3, progress=False, backend="cpu", exposure=0.3, **TINY)
    gains = np.array(json.loads((varied / "synth.json").read_text())["exposure_gains"])
    assert gains.shape == (17, 3) and (gains[::8] == 1).all() and np.ptp(gains[1:8]) > 0.2
    for k, name in enumerate(sorted(p.name for p in (out / "images").iterdir())):
        plain = np.asarray(Image.open(out / "images" / name), np.float64)
        image = np.asarray(Image.open(varied / "images" / name), np.float64)
        if k % 8 == 0:
            assert (image == plain).all(), name
            continue
        expected = np.clip(plain * gains[k], 0, 255)
        unclipped = (plain * gains[k] < 254).all(2)
        assert np.abs(image - expected)[unclipped].max() <= 0.5 * gains[k].max() + 0.51, name
        assert np.abs(image - plain).max() > 5, name


@pytest.mark.parametrize("args, message", [
    (["--preset", "huge"], "--preset must be one of small, large; got 'huge'"),
    (["--res", "0x36"], "--res must have a positive width and height"),
    (["--res", "64by36"], "--res must be WIDTHxHEIGHT"),
    (["--gaussians", "0"], "argument --gaussians: must be at least 1, got 0"),
    (["--views", "-3"], "argument --views: must be at least 1, got -3"),
    (["--seed", "x"], "argument --seed: expected an integer, got 'x'"),
    (["--exposure", "-1"], "--exposure must be a number in [0, 2), got -1.0"),
])
def test_bad_arguments_give_one_error_naming_the_option(tmp_path, capsys, args, message):
    argv = ["synth", "--out", str(tmp_path / "o"), "--views", "2", "--res", "32x18", "--quiet"] + args
    try:
        rc = cli.main(argv)
    except SystemExit as e:   # argparse: exit status 2
        rc = e.code
    assert rc in (1, 2)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_the_output_folder_must_be_new_or_empty_unless_forced(tmp_path, capsys):
    small = ["--preset", "small", "--gaussians", "8000", "--views", "2", "--res", "32x18", "--quiet"]
    afile = tmp_path / "file"
    afile.write_text("x")
    assert cli.main(["synth", "--out", str(afile)] + small) == 1
    assert f"--out {afile} is a file" in capsys.readouterr().err
    full = tmp_path / "full"
    (full / "images").mkdir(parents=True)
    (full / "images" / "99999_street.png").write_bytes(b"stale")
    (full / "notes.txt").write_text("keep")
    assert cli.main(["synth", "--out", str(full)] + small) == 1
    assert "is not empty; add --force" in capsys.readouterr().err
    assert cli.main(["synth", "--out", str(full), "--force"] + small) == 0
    assert sorted(p.name for p in (full / "images").iterdir()) == ["00000_street.png", "00001_aerial.png"]
    assert (full / "notes.txt").read_text() == "keep"
    assert "wrote" in capsys.readouterr().out


def test_smoke_synth_then_train_on_the_cpu(tmp_path):
    """The CI smoke test: the CLI writes a reduced city that ``train`` loads and trains on."""
    env = dict(os.environ, NUMBASPLAT_BACKEND="cpu")
    data, out = tmp_path / "city", tmp_path / "train"
    t0 = time.perf_counter()
    procs = []
    for argv in (["synth", "--out", data, "--gaussians", "8000", "--views", "9", "--res", "64x36"],
                 ["train", "--data", data, "--out", out, "--iters", "20", "--quiet", "--snapshot-every", "0", "--eval"]):
        procs.append(subprocess.run([sys.executable, "run.py", *map(str, argv)], cwd=REPO, env=env,
                                    capture_output=True, text=True, timeout=600))
        assert procs[-1].returncode == 0, procs[-1].stdout + procs[-1].stderr
    synth, train = procs
    assert "9/9" in synth.stderr and "wrote" in synth.stdout   # the progress bar (tqdm) ends at 9/9
    assert (out / "metrics.json").is_file() and "test PSNR" in train.stdout
    print(f"synth + train: {time.perf_counter() - t0:.1f} s")
