"""`flowrl config show [--config F] [key=value ...]`: print the resolved configuration as YAML.
`flowrl config docs [--write PAGE]`: the configuration reference's tables, from the fields'
docstrings (flowrl.config.reference), printed or written into a page's generated blocks.

The output of `show` is exactly what training would use (defaults, then the file, then the
overrides) and can be saved and passed back with --config.
"""

from __future__ import annotations

import argparse
import sys


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=["show", "docs"],
        help="show: print the resolved config as YAML; docs: print (or --write) the reference tables",
    )
    parser.add_argument(
        "--config", default=None, metavar="F", help="YAML file (e.g. a recipe) applied over the defaults"
    )
    parser.add_argument(
        "--write",
        default=None,
        metavar="PAGE",
        help="docs: rewrite the generated blocks of this markdown page (e.g. docs/config.md) in place",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides applied last, e.g. rollout.n=16 rollout.sampling.guidance_scale=4.5",
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "docs":
        return _docs(args)
    from flowrl.config import config_to_yaml, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as error:
        print(f"flowrl config: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(config_to_yaml(cfg))
    return 0


def _docs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flowrl.config.reference import documented_sections, render, section_table

    if args.write is None:
        for path in documented_sections():
            sys.stdout.write(f"### {path}\n\n{section_table(path)}\n")
        return 0
    page = Path(args.write)
    if not page.is_file():
        print(f"flowrl config: error: --write {args.write!r} is not a file; give a markdown page", file=sys.stderr)
        return 2
    page.write_text(render(page.read_text()))
    return 0
