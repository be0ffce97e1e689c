"""The `flowrl` command line: a table of subcommands, each implemented in its own module.

Each module named in COMMANDS exposes `build_parser(parser)` (adds its arguments to an argparse
parser) and `run(args) -> int` (the exit code). Only the module of the chosen subcommand is
imported, so `flowrl --help` and light commands stay fast. Before the command runs, known-harmless
third-party notices and nested progress bars are silenced (`flowrl.console.quiet_third_party`).

Every command's parser is a `CommandParser`: bad arguments print one line (`flowrl CMD: error:
...`) and exit 2, and each flag's help ends with its default (`HelpWithDefaults`). Options and
positional arguments may come in any order (`flowrl train key=v --config F key2=v2`), except in
commands with their own sub-commands (`flowrl data ocr`, `flowrl bench rollout`), where argparse
cannot intermix them (`parse_any_order`). The argument types shared by the commands live here too
(`positive_int`, `seed_int`).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

# name -> (module, one-line help). Multi-word commands ("data ocr", "bench rollout") are handled
# by the module's own sub-parsers.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flowrl.cli.train", "FlowGRPO training from a YAML recipe plus key=value overrides"),
    "eval": ("flowrl.cli.eval", "score a base model and its trained weights on a prompt file, with grids"),
    "generate": ("flowrl.cli.generate", "generate images with the rollout engine (base model or trained weights)"),
    "make-tiny": ("flowrl.cli.make_tiny", "build a tiny random diffusers checkpoint offline"),
    "make-toy": ("flowrl.cli.make_toy", "pretrain the toy world's small model (shapes and colours) offline"),
    "config": ("flowrl.cli.config", "show the resolved configuration as YAML"),
    "reward-score": ("flowrl.cli.reward_score", "score image files with a reward, one score per line"),
    "serve": ("flowrl.cli.serve", "serve a model over HTTP: OpenAI Images API, RL rollouts, weight updates"),
    "reward-server": ("flowrl.cli.reward_server", "serve a configured reward over HTTP (JSON + PNG)"),
    "data": ("flowrl.cli.data", "write prompt datasets (for example OCR prompts)"),
    "bench": ("flowrl.cli.bench", "benchmarks: rollout throughput, the whole training step, learning curves"),
}


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1 (0 and negatives are errors, never replaced by a default)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} must be an integer >= 1")
    return number


def positive_float(value: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
    return number


def seed_int(value: str) -> int:
    """argparse type: a seed in [0, 2^63 - 1], the range the engine takes (another value is an
    error, never mapped onto some other seed)."""
    from flowrl.sampling_params import MAX_SEED

    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if not 0 <= number <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{value} is not a seed; use an integer in [0, {MAX_SEED}]")
    return number


class HelpWithDefaults(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already names its default, the flag
    is a switch that defaults to off, or it has no default (then its help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default in (None, False, argparse.SUPPRESS) or action.required:
            return text
        if not action.option_strings:  # positionals: their default is "none given"
            return text
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default))
        return f"{text} (default: {default})" if default != "" else text


class CommandParser(argparse.ArgumentParser):
    """A command's parser: one-line errors with exit 2, help with defaults (module docstring).
    Sub-parsers (`flowrl data ocr`) are made of the same class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpWithDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str) -> CommandParser:
    """The full parser of command `name` (imports its module)."""
    module_name, help_text = COMMANDS[name]
    parser = CommandParser(prog=f"flowrl {name}", description=help_text)
    importlib.import_module(module_name).build_parser(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        # `flowrl` alone runs the main job: the embedded tiny training run.
        argv = ["train"]
    if argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = _top_level_parser()
        if argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}")
        parser.print_help()
        return 0
    from flowrl.console import quiet_third_party

    quiet_third_party()  # before the command's module imports transformers / huggingface_hub
    parser = command_parser(argv[0])
    args = parse_any_order(parser, argv[1:])
    return int(importlib.import_module(COMMANDS[argv[0]][0]).run(args) or 0)


def parse_any_order(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse with options and positionals intermixed (`key=v --config F key2=v2`).

    Plain `parse_args` stops collecting a `nargs="*"` positional at the first option, so overrides
    after an option fail as "unrecognized arguments". argparse can intermix only in a parser
    without sub-commands; one with sub-commands keeps the plain parse.
    """
    has_subcommands = any(isinstance(action, argparse._SubParsersAction) for action in parser._actions)
    return parser.parse_args(argv) if has_subcommands else parser.parse_intermixed_args(argv)
