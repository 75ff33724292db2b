"""cli/config.py: a flag for every TrainConfig field, the --config file (JSON, YAML) under the flags,
and its errors, each one line naming the file and the key."""
import argparse
import dataclasses
import json
import sys
import typing
from dataclasses import dataclass

import pytest

import cli
from cli import config, train
from engine.recipe.trainer import TrainConfig


@pytest.fixture
def resolved(monkeypatch):
    """cli.main(argv) -> (the options, the settings) that ``train`` would run with (nothing trains)."""
    seen = {}
    monkeypatch.setattr(train, "run_training", lambda a, settings: seen.update(a=a, settings=settings))

    def parse(*argv):
        assert cli.main(["train", *argv]) == 0
        return seen["a"], seen["settings"]
    return parse


def test_every_field_is_a_flag_with_help_and_its_default():
    p = train.train_parser()
    defaults = vars(p.parse_args([]))
    helps = config.field_comments(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        assert defaults[f.name] == f.default, f.name
        assert f.name in helps or "help" in config.FLAGS.get(f.name, {}), f"{f.name}: no comment for its help"
        flag = "--" + f.name.replace("_", "-")  # a config file's key with dashes is always its flag
        if isinstance(f.default, bool):
            assert getattr(p.parse_args([flag]), f.name) is True
            assert getattr(p.parse_args(["--no-" + flag[2:]]), f.name) is False
        elif isinstance(f.default, int):
            assert getattr(p.parse_args([flag, "2"]), f.name) == 2, f.name
        elif isinstance(f.default, tuple) and f.name.endswith("_at"):  # training steps (--save-at, --eval-at)
            assert getattr(p.parse_args([flag, "7", "3,5"]), f.name) == (3, 5, 7), f.name
        elif isinstance(f.default, tuple):
            assert getattr(p.parse_args([flag, "0.5", "0.5", "0.5"]), f.name) == [0.5] * 3, f.name
        elif not isinstance(f.default, str):  # a float, or None (lambda_s3im: a float; lr_means_steps: an int)
            value = 2 if int in typing.get_args(f.type) else 0.5
            assert getattr(p.parse_args([flag, str(value)]), f.name) == value, f.name
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            p.parse_args([flag, "-1"])  # no setting is negative


def test_flags_reach_the_config(resolved):
    a, settings = resolved("--data", "d", "--out", "o", "--iters", "7", "--lr-means", "1e-4", "--lr-means-final", "1e-6",
                           "--lr-scales", "0.004", "--lr-quats", "0.002", "--lr-opacities", "0.03", "--lr-sh", "0.001",
                           "--lambda-dssim", "0.3", "--sh-degree", "2", "--sh-increase-every", "500",
                           "--densify-from", "100", "--densify-until", "900", "--densify-every", "50",
                           "--opacity-reset-every", "400", "--grad-threshold", "3e-4", "--log-every", "5",
                           "--snapshot-every", "0", "--background", "0.5", "0.25", "1", "--init-points", "300",
                           "--resolution", "2", "--max-width", "0", "--test-every", "4")
    cfg = train.config_from_args(a)
    assert (cfg.iterations, cfg.lr_means, cfg.lr_means_final, cfg.lr_scales, cfg.lr_quats, cfg.lr_opacities,
            cfg.lr_sh) == (7, 1e-4, 1e-6, 0.004, 0.002, 0.03, 0.001)
    assert (cfg.lambda_dssim, cfg.sh_degree, cfg.sh_increase_every) == (0.3, 2, 500)
    assert (cfg.densify_from, cfg.densify_until, cfg.densify_every, cfg.opacity_reset_every) == (100, 900, 50, 400)
    assert (cfg.grad_threshold, cfg.log_every, cfg.snapshot_every, cfg.n_random_init) == (3e-4, 5, 0, 300)
    assert cfg.background == (0.5, 0.25, 1.0)
    assert (settings["resolution"], settings["max_width"], settings["test_every"]) == (2, 0, 4)
    assert "resume" not in settings and "config" not in settings
    # what is not given keeps its default
    assert (cfg.lr_means_steps, cfg.strategy, settings["format"], settings["eval"]) == (None, "default", "auto", False)


def test_the_strategy_takes_the_densification_settings(tmp_path):
    from engine.tools.demo import make_dataset
    from engine.pipelines.single_gpu import SingleGPUTrainer
    ds = make_dataset(size=16, n_views=3, backend="cpu")
    cfg = TrainConfig(iterations=800, densify_from=100, densify_until=700, densify_every=50, opacity_reset_every=400,
                      prune_opacity=0.01, percent_dense=0.02, grad_threshold=3e-4)
    s = SingleGPUTrainer(ds, tmp_path, cfg, backend="cpu").strategy
    assert (s.refine_start, s.refine_stop, s.refine_every, s.reset_every, s.prune_opacity, s.percent_dense,
            s.grad_threshold) == (100, 700, 50, 400, 0.01, 0.02, 3e-4)
    cfg = TrainConfig(strategy="mcmc", cap_max=99, opacity_reg=0.5, scale_reg=0.25, mcmc_noise_lr=7.0)
    s = SingleGPUTrainer(ds, tmp_path, cfg, backend="cpu").strategy
    assert (s.cap_max, s.opacity_reg, s.scale_reg, s.noise_lr) == (99, 0.5, 0.25, 7.0)
    assert s.regularise_from == 0
    s = SingleGPUTrainer(ds, tmp_path, TrainConfig(scale_reg=0.2), backend="cpu").strategy
    assert (type(s).__name__, s.opacity_reg, s.scale_reg, s.regularise_from) == ("DefaultStrategy", 0.01, 0.2, 7000)
    s = SingleGPUTrainer(ds, tmp_path, TrainConfig(opacity_reg=0.03, regularise_from=0), backend="cpu").strategy
    assert (s.opacity_reg, s.scale_reg, s.regularise_from, s.resets_until) == (0.03, 0.03, 0, 0)


def write(path, settings):
    path.write_text(json.dumps(settings))
    return str(path)


def test_flags_override_the_file_and_the_file_the_defaults(resolved, tmp_path):
    f = write(tmp_path / "run.json", {"data": "d", "out": "o", "iterations": 50, "lr_means": 0.001, "eval": True,
                                      "absgrad": True, "background": [1, 1, 1], "test_every": 4, "lambda_s3im": None})
    a, settings = resolved("--config", f, "--iters", "9", "--no-absgrad")
    cfg = train.config_from_args(a)
    assert (cfg.iterations, cfg.lr_means, cfg.absgrad, cfg.background) == (9, 0.001, False, (1.0, 1.0, 1.0))
    assert (a.eval, a.test_every, a.data, a.out, cfg.lr_scales, cfg.lambda_s3im) == (True, 4, "d", "o", 5e-3, None)
    a, _ = resolved("--config", f, "--no-eval", "--out", "elsewhere")
    assert (a.eval, a.out) == (False, "elsewhere")


def test_yaml_config(resolved, tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "run.yaml"
    f.write_text("data: d\nout: o\nlr_means: 1e-4   # YAML reads this as a string: checked as the flag would\n"
                 "sh_degree: 1\nloss: tile\nwhite_background: true\n")
    a, _ = resolved("--config", str(f))
    cfg = train.config_from_args(a)
    assert (cfg.lr_means, cfg.sh_degree, cfg.loss, cfg.background) == (1e-4, 1, "tile", (1.0, 1.0, 1.0))


def fails(capsys, *argv):
    assert cli.main(["train", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("settings, words", [
    ({"lr_mean": 0.1}, ["unknown key 'lr_mean'", "did you mean 'lr_means'"]),
    ({"iterations": "many"}, ["iterations", "expected an integer, got 'many'"]),
    ({"iterations": 0}, ["iterations", "must be at least 1"]),
    ({"loss": "l2"}, ["loss", "invalid choice"]),
    ({"eval": "yes"}, ["eval", "expected true or false"]),
    ({"data": True}, ["data", "expected a value"]),
    ({"background": [1, 1]}, ["background", "expected 3 arguments"]),
    ({"lambda_dssim": 2}, ["lambda_dssim", "between 0 and 1"]),
    ({"resume": True}, ["'resume' is not a setting", "--resume"]),
])
def test_a_bad_setting_is_one_line_naming_the_file_and_key(capsys, tmp_path, settings, words):
    f = write(tmp_path / "run.json", {"data": "d", "out": "o", **settings})
    err = fails(capsys, "--config", f)
    for w in [f"config file {f}", *words]:
        assert w in err, err


def test_bad_config_files(capsys, tmp_path, monkeypatch):
    assert "cannot read it" in fails(capsys, "--config", str(tmp_path / "missing.json"))
    (tmp_path / "run.toml").write_text("")
    assert "expected a .json, .yaml or .yml file" in fails(capsys, "--config", str(tmp_path / "run.toml"))
    (tmp_path / "bad.json").write_text("{data: d")
    assert "not valid JSON" in fails(capsys, "--config", str(tmp_path / "bad.json"))
    assert "expected a mapping" in fails(capsys, "--config", write(tmp_path / "list.json", [1, 2]))
    assert "--data is required" in fails(capsys, "--config", write(tmp_path / "no_data.json", {"out": "o"}))
    (tmp_path / "run.yaml").write_text("data: d\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    assert "pip install pyyaml" in fails(capsys, "--config", str(tmp_path / "run.yaml"))


def test_white_background_and_another_background_disagree(capsys):
    err = fails(capsys, "--data", "d", "--out", "o", "--white-background", "--background", "0.5", "0.5", "0.5")
    assert "--white-background" in err and "--background" in err


def test_field_comments_are_the_help():
    @dataclass
    class Settings:
        """A docstring: not a comment."""
        # a heading above a field is not its help
        plain: int = 1
        steps: int = 2        # how many steps
        rate: float = 0.5     # a rate, which
                              # continues here
        # another heading
        last: str = "x"       # the last one
    assert config.field_comments(Settings) == {"steps": "how many steps", "rate": "a rate, which continues here",
                                               "last": "the last one"}


def test_inria_and_gsplat_spellings_are_aliases(resolved):
    """Inria's -s/-m/-r/-i/-w and long names, gsplat's --data_dir/--data_factor, and every flag with
    underscores for dashes reach the same settings as ours (cli/args.py ALIASES)."""
    ours = resolved("--data", "d", "--out", "o", "--resolution", "2", "--images", "images_2", "--white-background",
                    "--grad-threshold", "3e-4", "--densify-until", "900", "--densify-from", "100", "--iters", "50",
                    "--no-absgrad", "--lr-means", "1e-5")
    inria = resolved("-s", "d", "-m", "o", "-r", "2", "-i", "images_2", "-w", "--densify_grad_threshold", "3e-4",
                     "--densify_until_iter", "900", "--densify_from_iter=100", "--iterations", "50", "--no_absgrad",
                     "--position_lr_init", "1e-5")
    gsplat = resolved("--data_dir", "d", "--result_dir", "o", "--data_factor", "2", "--images", "images_2",
                      "--white_background", "--grow_grad2d", "3e-4", "--refine_stop_iter", "900",
                      "--refine_start_iter", "100", "--max_steps", "50", "--no-absgrad", "--lr_means", "1e-5")
    assert ours[1] == inria[1] == gsplat[1]
    assert (ours[1]["data"], ours[1]["out"], ours[1]["iterations"], ours[1]["grad_threshold"]) == ("d", "o", 50, 3e-4)
    long_names = resolved("--source-path", "d", "--model-path", "o")[1]
    assert (long_names["data"], long_names["out"]) == ("d", "o")


def test_inria_m_is_the_model_where_a_command_reads_one():
    a = cli.parser().parse_args(["eval", "-m", "trained", "-s", "d", "-r", "4"])
    assert (a.model, a.data, a.resolution, a.out) == ("trained", "d", 4, None)


def test_config_keys_take_the_aliases(resolved, tmp_path, capsys):
    f = write(tmp_path / "inria.json", {"source_path": "d", "model_path": "o", "iters": 9, "data_factor": 2,
                                        "densify_grad_threshold": 3e-4, "densify_until_iter": 900,
                                        "white-background": True})
    a, settings = resolved("--config", f)
    assert (a.data, a.out, a.iterations, a.resolution, a.grad_threshold, a.densify_until, a.white_background) == (
        "d", "o", 9, 2, 3e-4, 900, True)
    err = fails(capsys, "--config", write(tmp_path / "twice.json", {"data": "d", "out": "o", "iters": 9,
                                                                   "iterations": 8}))
    assert "'iters' and 'iterations' are the same setting" in err


def exits_2(capsys, *argv):
    """The one line of stderr of ``run.py ARGV`` that argparse ends with exit status 2."""
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


@pytest.mark.parametrize("argv, said", [
    (["train", "--data", "d", "--iterz", "5"], "unknown option --iterz; did you mean --iters?"),
    (["train", "--densify-untill", "900"], "unknown option --densify-untill; did you mean --densify-until?"),
    (["eval", "--model", "m", "--test-evry", "4"], "unknown option --test-evry; did you mean --test-every?"),
    (["train", "--data", "d", "-x", "3"], "unknown option -x; run.py train --help lists them"),
])
def test_an_unknown_option_is_one_line_naming_the_closest(capsys, argv, said):
    assert exits_2(capsys, *argv) == f"error: {said}"


@pytest.mark.parametrize("argv, said", [
    (["train", "--data", "d", "--iters", "abc"], "argument --iters/--iterations: expected an integer, got 'abc'"),
    (["train", "--data", "d", "--resolution", "0"], "argument --resolution: "),
    (["train", "--loss", "l2"], "argument --loss: invalid choice: 'l2'"),
    (["eval", "--resolution", "x"], "argument --resolution: "),
    (["eval"], "the following arguments are required: --model"),
    (["trian"], "argument cmd: invalid choice: 'trian'"),
])
def test_a_bad_value_is_one_line_not_the_usage(capsys, argv, said):
    assert exits_2(capsys, *argv).startswith(f"error: {said}")


def test_their_save_eval_and_init_options_are_aliases(resolved):
    """Inria's --save_iterations / --test_iterations (lists after one flag) and gsplat's --save_steps /
    --eval_steps / --init_num_pts / --init_opa / --sh_degree_interval reach ours."""
    ours = resolved("--data", "d", "--out", "o", "--save-at", "300", "900", "--eval-at", "500", "--init-points", "700",
                    "--init-opacity", "0.2", "--sh-increase-every", "250", "--host", "0.0.0.0")[1]
    inria = resolved("-s", "d", "-m", "o", "--save_iterations", "300", "900", "--test_iterations", "500",
                     "--init-points", "700", "--init-opacity", "0.2", "--sh-increase-every", "250",
                     "--ip", "0.0.0.0")[1]
    gsplat = resolved("--data_dir", "d", "--result_dir", "o", "--save_steps", "300", "900", "--eval_steps", "500",
                      "--init_num_pts", "700", "--init_opa", "0.2", "--sh_degree_interval", "250", "--host",
                      "0.0.0.0")[1]
    assert ours == inria == gsplat
    assert ours["save_at"] != resolved("--data", "d", "--out", "o")[1]["save_at"]


@pytest.mark.parametrize("flag, words", [("--checkpoint_iterations", "--snapshot-every"),
                                         ("--start_checkpoint", "--resume"), ("--disable-viewer", "--viewer")])
def test_their_options_that_mean_something_else_say_what_to_give(capsys, flag, words):
    err = exits_2(capsys, "train", "--data", "d", flag, "5")
    assert err.startswith(f"error: unknown option {flag.replace('_', '-')}: ") and words in err, err


def test_a_config_key_that_means_something_else_says_what_to_give(capsys, tmp_path):
    err = fails(capsys, "--config", write(tmp_path / "inria.json", {"data": "d", "checkpoint_iterations": [100]}))
    assert "unknown key 'checkpoint_iterations': " in err and "--snapshot-every" in err, err
