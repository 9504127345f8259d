"""Config validation shared by the three recipes (train/config.py `coerce` and `check`,
train/engine.py TRAIN_RULES, each recipe's RULES): a wrong YAML value or flag is one line naming
the file and key or the flag, before anything runs."""

import dataclasses
import re
from typing import Optional, Union

import pytest

from mtpkit.train import byte_lm, gated_lora, mtpc, recipe_config
from mtpkit.train.config import ConfigError, _flag_fields, check, from_dict, to_yaml

RECIPES = {"gated_lora": gated_lora, "mtpc": mtpc, "byte_lm": byte_lm}


def _error(recipe, argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        recipe.parse_args(argv)
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors  # one line, no traceback
    return errors[0]


def _yaml(tmp_path, text) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, needle", [
    ('max_steps: "2"\n', "max_steps must be an integer, got '2'"),
    ("max_steps: 2.7\n", "max_steps must be an integer, got 2.7"),
    ("max_steps: true\n", "max_steps must be an integer, got True"),   # a bool is not an int
    ('tensorboard: "no"\n', "tensorboard must be true or false, got 'no'"),
    ("tensorboard: 1\n", "tensorboard must be true or false, got 1"),
    ("model:\n  target_modules: q_proj\n", "model.target_modules must be a list of strings"),
    ("model:\n  target_modules: [q_proj, 3]\n", "model.target_modules[1] must be a string, got 3"),
    ("model:\n  k: 2.5\n", "model.k must be an integer, got 2.5"),
    ("model: 3\n", "model must be a mapping"),
    ("model:\n  kk: 3\n", "unknown key(s) ['model.kk']"),
    ("3\n", "the file must be a mapping"),
    ("- max_steps\n", "the file must be a mapping"),
    ("lr: .inf\n", "lr must be a finite number, got inf"),
    ("lr: .nan\n", "lr must be a finite number, got nan"),
    ("lr: fast\n", "lr must be a finite number, got 'fast'"),
    ("output_dir: 3\n", "output_dir must be a string, got 3"),
    ("max_steps:\n", "max_steps must be an integer, got None"),
])
def test_yaml_values_are_checked_against_the_field_types(tmp_path, capsys, text, needle):
    path = _yaml(tmp_path, text)
    line = _error(gated_lora, ["--config", path], capsys)
    assert path in line and needle in line, line


def test_yaml_numbers_are_read_as_the_field_type(tmp_path):
    cfg = gated_lora.parse_args(["--config", _yaml(tmp_path, "lr: 2e-4\nmin_lr_ratio: 0\nmodel:\n  alpha: 8\n")])
    assert cfg.lr == 2e-4 and type(cfg.min_lr_ratio) is float and type(cfg.model.alpha) is float  # ints -> floats


def test_the_resolved_config_reads_back(tmp_path):
    for recipe in RECIPES.values():
        cfg = recipe.parse_args([])
        again = recipe.parse_args(["--config", _yaml(tmp_path, to_yaml(cfg, "python x.py"))])
        assert again == cfg, recipe.__name__


@dataclasses.dataclass
class Inner:
    sizes: list[int] = dataclasses.field(default_factory=list)
    scale: Optional[float] = None
    name: Union[int, str] = 0


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    flag: bool = False


def test_nested_optional_union_and_list_items_are_checked():
    ok = from_dict(Outer, {"inner": {"sizes": [1, 2], "scale": 3, "name": "a"}, "flag": True}, "x.yaml")
    assert ok == Outer(Inner([1, 2], 3.0, "a"), True) and type(ok.inner.scale) is float
    assert from_dict(Outer, {"inner": {"scale": None, "name": 4}}, "x.yaml").inner == Inner([], None, 4)
    for values, needle in (({"inner": {"sizes": [1, 2.5]}}, "x.yaml: inner.sizes[1] must be an integer"),
                           ({"inner": {"sizes": 3}}, "x.yaml: inner.sizes must be a list of integers"),
                           ({"inner": {"scale": "inf"}}, "x.yaml: inner.scale must be a finite number or null"),
                           ({"inner": {"name": 1.5}}, "x.yaml: inner.name must be an integer or a string"),
                           ({"inner": []}, "x.yaml: inner must be a mapping"),
                           ({"flag": "yes"}, "x.yaml: flag must be true or false")):
        with pytest.raises(ConfigError, match="^" + re.escape(needle)):
            from_dict(Outer, values, "x.yaml")


@pytest.mark.parametrize("recipe, argv, needle", [
    (mtpc, ["--lr", "inf"], "--lr must be a finite number, got inf"),
    (mtpc, ["--lr", "nan"], "--lr must be a finite number, got nan"),
    (gated_lora, ["--lr", "0"], "--lr must be > 0"),
    (gated_lora, ["--alpha=-inf"], "--alpha must be a finite number"),
    (gated_lora, ["--save-every", "0"], "--save-every must be >= 1, got 0"),
    (gated_lora, ["--log-every", "0"], "--log-every must be >= 1, got 0"),
    (gated_lora, ["--eval-every", "-1"], "--eval-every must be >= 0, got -1"),
    (gated_lora, ["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
    (gated_lora, ["--max-steps", "-3"], "--max-steps must be >= 1, got -3"),  # not --decay-steps
    (byte_lm, ["--max-steps", "-3"], "--max-steps must be >= 1, got -3"),     # its decay_steps is -1
    (gated_lora, ["--max-steps", "10", "--decay-steps", "11"], "--decay-steps must be -1 or in [0, --max-steps]"),
    (gated_lora, ["--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1]"),
    (gated_lora, ["--seed", "-1"], "--seed must be >= 0"),
    (gated_lora, ["--nonfinite", "ignore"], "--nonfinite must be one of stop, skip"),
    (gated_lora, ["--k", "0"], "--k must be >= 1, got 0"),
    (gated_lora, ["--rank", "0"], "--rank must be >= 1, got 0"),
    (gated_lora, ["--dropout", "1"], "--dropout must be in [0, 1)"),
    (gated_lora, ["--target-modules", ""], "--target-modules must be given"),
    (gated_lora, ["--eval-decoding", "cubic"], "--eval-decoding must be one of"),
    (gated_lora, ["--dtype", "int8"], "--dtype must be one of"),
    (mtpc, ["--gamma", "-5"], "--gamma must be in [0, 1], got -5.0"),
    (mtpc, ["--windows-per-sequence", "-1"], "--windows-per-sequence must be >= 0, got -1"),
    (mtpc, ["--r", "0"], "--r must be >= 1, got 0"),
    (mtpc, ["--rank", "0"], "--r must be >= 1, got 0"),
    (mtpc, ["-n", "0"], "--n must be >= 2, got 0"),
    (mtpc, ["--window", "12"], "--n must be a power-of-two window for --arch btree, got 12"),
    (mtpc, ["--arch", "tree"], "--arch must be one of"),
    (mtpc, ["--lora-rank", "0"], "--lora-rank must be >= 1"),
    (mtpc, ["--lora-layers", "-1"], "--lora-layers must be >= 0"),
    (mtpc, ["--kl-weight", "-1"], "--kl-weight must be >= 0"),
    (byte_lm, ["--num-heads", "0"], "--num-heads must be >= 1"),
    (byte_lm, ["--hidden-size", "0"], "--hidden-size must be >= 1"),
    (byte_lm, ["--hidden-size", "6", "--num-heads", "2", "--num-kv-heads", "1"],
     "--hidden-size must be --num-heads times an even"),
    (byte_lm, ["--num-heads", "6", "--num-kv-heads", "4"], "--num-heads must be a multiple of --num-kv-heads"),
    (byte_lm, ["--stdlib-mb", "-1"], "--stdlib-mb must be >= 0"),
    (byte_lm, ["--data", ""], "--data must be given"),
])
def test_flags_out_of_range_name_the_flag(capsys, recipe, argv, needle):
    line = _error(recipe, argv, capsys)
    assert needle in line, line


def test_every_rule_names_a_field_and_the_defaults_pass_them():
    for recipe in RECIPES.values():
        cfg = recipe.parse_args([])
        names = {path[-1] for path, _, _ in _flag_fields(type(cfg))}
        rules = recipe_config.TRAIN_RULES + recipe.RULES
        assert {name for name, _, _ in rules} <= names, recipe.__name__
        check(cfg, rules)


def test_mtpc_zero_gamma_still_means_the_paper_default():
    assert mtpc.parse_args([]).gamma == 0.9 and mtpc.parse_args(["-n", "8"]).gamma == 0.8
    assert mtpc.parse_args(["--gamma", "1"]).gamma == 1.0
