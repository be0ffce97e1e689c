"""`flowrl reward-score`: score image files with a reward and print one score per line.

    flowrl reward-score --reward ocr --ground-truth "OPEN 24 HOURS" sign.png
    flowrl reward-score --reward clip_score --option model_path=/models/clip --prompt "a cat" cat.png
    flowrl reward-score --spec-file recipe.yaml a.png b.png      # the recipe's `reward:` section

Also holds the reward-choosing arguments shared with `flowrl reward-server`.
A failed (optional) score prints `nan`; a failed required reward exits 1 with the error; bad
input (an unknown reward or option, a file that is not a readable image, a missing --spec-file)
exits 2 with one line naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

CONFIG_FIELDS = ("name", "options", "components", "route_by_data_source", "num_workers")


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    choose = parser.add_argument_group("reward choice")
    choose.add_argument("--reward", help="registered reward name (e.g. ocr, jpeg_compressibility, clip_score)")
    choose.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a reward option; VALUE is parsed as JSON when it can be (repeatable)",
    )
    choose.add_argument(
        "--spec-file",
        type=Path,
        help="YAML/JSON file with a reward section (name, options, components, route_by_data_source), "
        "either at the top level or under a 'reward' key",
    )


def parse_option(text: str) -> tuple[str, object]:
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise ValueError(f"--option {text!r} must look like KEY=VALUE, e.g. --option quality=90")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a plain string such as a path


def reward_from_args(args: argparse.Namespace):
    """Build the reward chosen by --reward/--option or --spec-file."""
    from flowrl.rewards import build_reward_from_config

    if (args.reward is None) == (args.spec_file is None):
        raise ValueError("give exactly one of --reward NAME or --spec-file FILE")
    if args.spec_file is not None:
        import yaml

        try:
            section = yaml.safe_load(args.spec_file.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"--spec-file {str(args.spec_file)!r} does not exist; pass a YAML/JSON reward file"
            ) from None
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
            raise ValueError(f"--spec-file {str(args.spec_file)!r} cannot be read as YAML/JSON ({error})") from None
        if isinstance(section, dict) and isinstance(section.get("reward"), dict):
            section = section["reward"]
        if not isinstance(section, dict):
            raise ValueError(f"--spec-file {args.spec_file} must hold a mapping (a reward section)")
        unknown = sorted(set(section) - set(CONFIG_FIELDS))
        if unknown:
            raise ValueError(
                f"--spec-file {args.spec_file}: unknown reward field(s) {unknown}; allowed: {CONFIG_FIELDS}"
            )
        if args.option:
            raise ValueError("--option applies to --reward; put options inside the --spec-file instead")
        return build_reward_from_config(SimpleNamespace(**{"name": None, **section}))
    options = dict(parse_option(text) for text in args.option)
    return build_reward_from_config(SimpleNamespace(name=args.reward, options=options))


def load_image_chw(path: Path) -> np.ndarray:
    from PIL import Image

    if not path.is_file():
        raise ValueError(f"image file {str(path)!r} does not exist")
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB")).transpose(2, 0, 1).copy()
    except Image.DecompressionBombError as error:  # far more pixels than any generated image
        raise ValueError(f"image file {str(path)!r} is refused: {error}; score a smaller image") from None
    except (OSError, SyntaxError, ValueError) as error:  # not an image, truncated, damaged
        raise ValueError(
            f"image file {str(path)!r} cannot be read as an image ({type(error).__name__}: {error}); "
            "pass a complete PNG, JPEG or other PIL-readable file"
        ) from None


def build_parser(parser: argparse.ArgumentParser) -> None:
    add_reward_arguments(parser)
    parser.add_argument("--ground-truth", default=None, help="metadata ground_truth of every image (OCR target text)")
    parser.add_argument("--prompt", default="", help="the prompt of every image (CLIP-family rewards)")
    parser.add_argument("--data-source", default=None, help="metadata data_source of every image (for routing)")
    parser.add_argument("images", nargs="+", type=Path, help="image files (any PIL-readable format; converted to RGB)")


def run(args: argparse.Namespace) -> int:
    from flowrl.rewards import RewardError

    try:
        reward = reward_from_args(args)
        metadata = {}
        if args.ground_truth is not None:
            metadata["ground_truth"] = args.ground_truth
        if args.data_source is not None:
            metadata["data_source"] = args.data_source
        for path in args.images:
            # One image per call: files may differ in size, and this is a tool for quick checks.
            score = reward(load_image_chw(path)[None], [args.prompt], [dict(metadata)])[0]
            print(f"{score:.6g}", flush=True)
    except (ValueError, RewardError) as error:
        print(f"flowrl reward-score: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    return 0
