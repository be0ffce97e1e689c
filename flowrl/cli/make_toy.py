"""`flowrl make-toy OUT`: pretrain the toy world's model and save it as a diffusers folder.

    flowrl make-toy outputs/toy-cpu                      # the committed model's recipe (seed 0)
    flowrl make-toy outputs/toy-gpu --size gpu           # the larger one, on a GPU
    flowrl make-toy outputs/toy-video --size video-cpu   # the video world's tiny Wan (committed, seed 0)
    flowrl make-toy outputs/toy-video-gpu --size video-gpu   # its larger size, on a GPU
    flowrl make-toy outputs/toy-weak --size gpu --steps 1000   # the same architecture, pretrained less

Prints the folder, the parameters per component, its size on disk and how long it took.
"""

from __future__ import annotations

import argparse
import sys
import time

from flowrl.cli import positive_int, seed_int
from flowrl.output_paths import OutputExistsError

# flowrl.models.debug.toy.SIZES' names (kept here so the parser needs no torch; a test checks they agree).
SIZE_NAMES = ("cpu", "gpu", "video-cpu", "video-gpu")


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="folder to save to: new or empty, or one make-toy wrote")
    parser.add_argument(
        "--size",
        default="cpu",
        choices=SIZE_NAMES,
        help="cpu: the committed model; gpu: larger; video-cpu: the video toy world's (committed) model; "
        "video-gpu: its larger size",
    )
    parser.add_argument("--seed", type=seed_int, default=0, help="data, noise and weight seed; same seed, same weights")
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="transformer pretraining steps (default: the size's)"
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="latents per transformer pretraining step (default: the size's)",
    )
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty folder flowrl did not create (same-named files are replaced, no file is "
        "deleted); without it such a folder is refused",
    )


def run(args: argparse.Namespace) -> int:
    from flowrl.config.sections import is_device_name, resolve_device
    from flowrl.models.debug.tiny import parameter_counts
    from flowrl.models.debug.toy import make_toy_checkpoint
    from flowrl.output_paths import file_sizes
    from flowrl.run.checks import check_cuda_device

    if not is_device_name(args.device):
        print(
            f"flowrl make-toy: error: --device {args.device!r} is invalid; use auto, cpu, cuda or cuda:N",
            file=sys.stderr,
        )
        return 2
    device = resolve_device(args.device)
    try:
        check_cuda_device(device, "--device ", "--device cpu")
    except ValueError as error:
        print(f"flowrl make-toy: error: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        path, built = make_toy_checkpoint(
            args.out,
            args.size,
            seed=args.seed,
            device=device,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            steps=args.steps,
            batch=args.batch,
        )
    except OutputExistsError as error:
        print(f"flowrl make-toy: error: {error}", file=sys.stderr)
        return 2
    counts = parameter_counts(path)
    megabytes = sum(file_sizes(path).values()) / 1e6
    print(path if built else f"{path} (already holds the toy {args.size} model of seed {args.seed}; kept as it is)")
    for component, count in counts.items():
        print(f"  {component}: {count:,} parameters")
    print(f"  total: {sum(counts.values()):,} parameters, {megabytes:.1f} MB on disk")
    if built:
        print(f"  built on {device} in {time.perf_counter() - start:.0f} s")
    return 0
