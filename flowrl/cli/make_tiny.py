"""`flowrl make-tiny`: build a tiny random diffusers checkpoint offline and print its size."""

from __future__ import annotations

import argparse
import sys

from flowrl.cli import seed_int
from flowrl.models.debug.tiny import TINY_KINDS, build_tiny_checkpoint, parameter_counts


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=sorted(TINY_KINDS), help="model family (required)")
    parser.add_argument("--seed", type=seed_int, default=0, help="weight seed; same seed, same bytes (default 0)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty folder flowrl did not create (same-named files are replaced, no file is "
        "deleted); without it such a folder is refused",
    )
    parser.add_argument(
        "out", help="folder to save to: new or empty, or one make-tiny wrote (reused as is for the same kind and seed)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        path = build_tiny_checkpoint(args.kind, args.out, seed=args.seed, overwrite=args.overwrite)
    except ValueError as error:  # OutputExistsError, or a folder that cannot be written
        print(f"flowrl make-tiny: error: {error}", file=sys.stderr)
        return 2
    counts = parameter_counts(path)
    print(path)
    for component, count in counts.items():
        print(f"  {component}: {count:,} parameters")
    print(f"  total: {sum(counts.values()):,} parameters")
    return 0
