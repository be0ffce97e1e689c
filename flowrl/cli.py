"""The `flowrl` command line: a table of subcommands, each implemented in its own module.

Each module named in COMMANDS exposes `build_parser(parser)` (adds its arguments to an argparse
parser) and `run(args) -> int` (the exit code). Only the module of the chosen subcommand is
imported, so `flowrl --help` and light commands stay fast. Options and positional arguments may
come in any order (`flowrl train key=v --config F key2=v2`), except in commands with their own
sub-commands (`flowrl data ocr`, `flowrl bench rollout`), where argparse cannot intermix them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Multi-word commands ("data ocr", "bench rollout") are handled
# by the module's own sub-parsers.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flowrl.trainer.cli", "FlowGRPO training from a YAML recipe plus key=value overrides"),
    "generate": ("flowrl.engine.cli", "generate images with the rollout engine and print batching stats"),
    "make-tiny": ("flowrl.models.tiny_cli", "build a tiny random diffusers checkpoint offline"),
    "config": ("flowrl.config_cli", "show the resolved configuration as YAML"),
    "reward-score": ("flowrl.rewards.cli", "score image files with a reward, one score per line"),
    "reward-server": ("flowrl.server.reward_cli", "serve a configured reward over HTTP (JSON + PNG)"),
    "data": ("flowrl.data.cli", "write prompt datasets (for example OCR prompts)"),
    "bench": ("flowrl.bench.cli", "benchmarks: rollout throughput and log-prob parity"),
}


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
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
    module_name, help_text = COMMANDS[argv[0]]
    from flowrl.console import quiet_third_party

    quiet_third_party()
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"flowrl {argv[0]}", description=help_text)
    module.build_parser(parser)
    args = parse_any_order(parser, argv[1:])
    return int(module.run(args) or 0)


def parse_any_order(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse with options and positionals intermixed (`key=v --config F key2=v2`).

    Plain `parse_args` stops collecting a `nargs="*"` positional at the first option, so overrides
    after an option fail as "unrecognized arguments". Parsers with sub-commands cannot be parsed
    intermixed (argparse raises TypeError for them); they keep the plain parse.
    """
    try:
        return parser.parse_intermixed_args(argv)
    except TypeError:
        return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
