"""Every command's command line: each flag has a help text that ends with its default, and bad
arguments print one line and exit 2 (flowrl.cli.CommandParser)."""

from __future__ import annotations

import argparse

import pytest

from flowrl.cli import COMMANDS, command_parser, main


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
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"flowrl {argv[0]}")
