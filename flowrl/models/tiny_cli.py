"""`flowrl make-tiny`: build a tiny random diffusers checkpoint offline and print its size."""

from __future__ import annotations

import argparse

from flowrl.models.tiny import TINY_KINDS, build_tiny_checkpoint, parameter_counts


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=sorted(TINY_KINDS), help="model family")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument("out", help="folder to save to; reused as is if it holds this kind already")


def run(args: argparse.Namespace) -> int:
    path = build_tiny_checkpoint(args.kind, args.out, seed=args.seed)
    counts = parameter_counts(path)
    print(path)
    for component, count in counts.items():
        print(f"  {component}: {count:,} parameters")
    print(f"  total: {sum(counts.values()):,} parameters")
    return 0
