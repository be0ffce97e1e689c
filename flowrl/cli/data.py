"""`flowrl data`: write prompt datasets.

    flowrl data ocr --num 1000 --out data/ocr_train.jsonl [--seed 0]
    flowrl data toy --split val --out data/toy_val.jsonl        # the toy world's held-out prompts
    flowrl data toy-video --split val --out data/toy_video_val.jsonl   # the video toy world's

writes one JSON object per line: {"prompt", "ground_truth", "data_source": "ocr"} (toy: also
"category"; flowrl.data.toy_split and toy_video_split say what each split holds).
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
    worlds = {
        "toy": "the toy world's prompts: RL training (train), held-out (val) or pretraining",
        "toy-video": "the video toy world's prompts (one object moving): RL training, held-out or pretraining",
    }
    for name, help_text in worlds.items():
        world = sub.add_parser(name, help=help_text)
        world.add_argument(
            "--split",
            required=True,
            choices=("train", "val", "pretrain"),
            help="train: the RL prompts; val: the held-out evaluation prompts (disjoint from train); pretrain: "
            "captions drawn as pretraining draws them",
        )
        world.add_argument("--out", type=Path, required=True, help="output .jsonl file")
        world.add_argument(
            "--num", type=int, default=None, help="rows: the first N of train/val (default all); pretrain: N"
        )
        world.add_argument("--seed", type=int, default=0, help="pretrain only: the draw's seed (train/val are fixed)")
        world.add_argument("--overwrite", action="store_true", help="replace --out when it exists (refused otherwise)")


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
    if args.dataset in ("toy", "toy-video"):
        return _write_toy(args)
    raise AssertionError(f"unhandled dataset {args.dataset!r}")


def _write_toy(args: argparse.Namespace) -> int:
    from flowrl.data.ocr_prompts import write_jsonl
    from flowrl.data.toy_split import prompt_rows
    from flowrl.data.toy_video_split import video_prompt_rows
    from flowrl.output_paths import OutputExistsError, check_output_file

    try:
        check_output_file(args.out, args.overwrite)
        if args.num is not None and args.num < 1:
            raise ValueError(f"--num {args.num} must be >= 1")
        rows = (prompt_rows if args.dataset == "toy" else video_prompt_rows)(args.split, args.num, args.seed)
    except (OutputExistsError, ValueError) as error:
        print(f"flowrl data {args.dataset}: error: {error}", file=sys.stderr)
        return 2
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} {args.split} rows to {args.out}")
    return 0
