"""`flowrl data`: write prompt datasets.

    flowrl data ocr --num 1000 --out data/ocr_train.jsonl [--seed 0]

writes one JSON object per line: {"prompt", "ground_truth", "data_source": "ocr"}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowrl.cli import seed_int


def build_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    ocr = sub.add_parser("ocr", help="prompts asking for a quoted text in a scene; the text is the ground_truth")
    ocr.add_argument("--num", type=int, required=True, help="number of rows to write")
    ocr.add_argument("--out", type=Path, required=True, help="output .jsonl file")
    ocr.add_argument("--seed", type=seed_int, default=0, help="random seed (same seed, same rows)")
    ocr.add_argument("--overwrite", action="store_true", help="replace --out when it exists (refused otherwise)")


def run(args: argparse.Namespace) -> int:
    from flowrl.data.ocr_prompts import make_ocr_rows, write_jsonl
    from flowrl.output_paths import check_output_file

    if args.dataset == "ocr":
        try:
            check_output_file(args.out, args.overwrite)
        except ValueError as error:  # OutputExistsError, or a path that cannot be written
            print(f"flowrl data ocr: error: {error}", file=sys.stderr)
            return 2
        try:
            rows = make_ocr_rows(args.num, seed=args.seed)
        except ValueError as error:
            print(f"flowrl data ocr: error: {error} (pass --num N with N >= 1)", file=sys.stderr)
            return 2
        write_jsonl(rows, args.out)
        print(f"wrote {len(rows)} rows to {args.out}")
        return 0
    raise AssertionError(f"unhandled dataset {args.dataset!r}")
