"""`flowrl config show [--config F] [key=value ...]`: print the resolved configuration as YAML.

The output is exactly what training would use (defaults, then the file, then the overrides) and
can be saved and passed back with --config.
"""

from __future__ import annotations

import argparse
import sys


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["show"], help="show: print the resolved config as YAML")
    parser.add_argument(
        "--config", default=None, metavar="F", help="YAML file (e.g. a recipe) applied over the defaults"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides applied last, e.g. rollout.n=16 rollout.sampling.guidance_scale=4.5",
    )


def run(args: argparse.Namespace) -> int:
    from flowrl.config import config_to_yaml, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as error:
        print(f"flowrl config: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(config_to_yaml(cfg))
    return 0
