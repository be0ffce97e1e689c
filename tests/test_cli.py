"""The `flowrl` entry point: options and overrides in any order for every command that takes both."""

from __future__ import annotations

import pytest
import yaml

from flowrl.cli import main


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
    import argparse

    from flowrl.cli import parse_any_order
    from flowrl.trainer.cli import build_parser

    parser = argparse.ArgumentParser()
    build_parser(parser)
    args = parse_any_order(parser, ["a=1", "--config", "F", "b=2"])
    assert args.config == "F" and args.overrides == ["a=1", "b=2"]
