"""Every command's command line: each flag has a help text that ends with its default, bad
arguments print one line and exit 2 (flowrl.cli.CommandParser), and options and overrides come in
any order for every command that takes both."""

from __future__ import annotations

import argparse

import pytest
import yaml

from flowrl.cli import COMMANDS, command_parser, main, parse_any_order


def _parsers(parser: argparse.ArgumentParser):
    """The parser and every sub-parser under it (`flowrl data ocr`, `flowrl bench rollout`)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_has_help_with_its_default(name):
    for parser in _parsers(command_parser(name)):
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            label = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{label} has no help"
            has_default = action.default not in (None, False, [], "", argparse.SUPPRESS) and action.option_strings
            if has_default and not action.required:
                assert "default" in parser._get_formatter()._get_help_string(action).lower(), label
        assert "(default: None)" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--steps", "x"],
        ["eval", "--model"],
        ["data", "ocr", "--num", "x"],
        ["make-tiny", "--kind", "bogus", "out"],
        ["bench", "rollout", "--steps", "0"],
        ["config", "shows"],
        ["generate", "--model", "m", "--prompt", "a", "--out", "o", "--seed", "-5"],  # never another seed
        ["generate", "--model", "m", "--prompt", "a", "--out", "o", "--seed", str(2**63)],
        ["make-tiny", "--kind", "sd3", "--seed", "-1", "out"],
        ["data", "ocr", "--num", "2", "--out", "x.jsonl", "--seed", "-1"],
        ["bench", "rollout", "--seed", "-1"],
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"flowrl {argv[0]}")


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("rollout:\n  n: 6\ntrainer:\n  lr: 0.125\n")
    return path


@pytest.mark.parametrize(
    "order",
    [
        ["show", "--config", "{recipe}", "trainer.total_steps=7", "rollout.sampling.noise_level=0.5"],
        ["show", "trainer.total_steps=7", "--config", "{recipe}", "rollout.sampling.noise_level=0.5"],
        ["show", "trainer.total_steps=7", "rollout.sampling.noise_level=0.5", "--config", "{recipe}"],
        ["--config", "{recipe}", "show", "trainer.total_steps=7", "rollout.sampling.noise_level=0.5"],
    ],
)
def test_config_show_takes_options_and_overrides_in_any_order(order, recipe, capsys):
    argv = [part.format(recipe=recipe) for part in order]
    assert main(["config", *argv]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["trainer"]["total_steps"] == 7 and shown["rollout"]["sampling"]["noise_level"] == 0.5
    assert shown["rollout"]["n"] == 6 and shown["trainer"]["lr"] == 0.125  # the file applies, overrides last


def test_train_takes_overrides_before_and_after_config(recipe, capsys):
    # A bad override after --config is reached (and reported) rather than "unrecognized arguments".
    code = main(["train", "trainer.total_steps=7", "--config", str(recipe), "rollout.n=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rollout.n=1" in err[0] and "unrecognized" not in err[0]


def test_train_parses_intermixed_arguments():
    args = parse_any_order(command_parser("train"), ["a=1", "--config", "F", "b=2"])
    assert args.config == "F" and args.overrides == ["a=1", "b=2"]


@pytest.mark.parametrize("key", ["rollout.seed", "rollout.val_seed"])
def test_a_seed_outside_the_engines_range_is_an_error(key):
    from flowrl.config import load_config

    with pytest.raises(ValueError, match=rf"{key}=-5.*\[0, 9223372036854775807\]"):
        load_config(None, [f"{key}=-5"])
