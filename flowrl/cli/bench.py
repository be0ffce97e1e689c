"""`flowrl bench rollout|train|learn ...` (see flowrl.bench.rollout / .train / .learn).

--model takes a local diffusers folder or a named architecture with random weights (the names of
flowrl.models.debug.architectures: published sizes, built on the device in the model dtype, and the
`tiny-*` ones for CPU smoke tests). `train` takes a recipe
and its overrides instead, as `flowrl train` does (`model.path=random:NAME` for those
architectures); so does `learn`, with runs (`--run 'NAME: key=value ...'`) compared side by side.
The experiments in benchmarks/ reuse the common options (`add_common_arguments`,
`add_compile_arguments`).
"""

from __future__ import annotations

import argparse

from flowrl.cli import positive_float, positive_int, seed_int
from flowrl.models.debug.architectures import ARCHITECTURES


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help=f"local diffusers folder, or {' | '.join(ARCHITECTURES)} (random weights)",
    )
    parser.add_argument("--steps", type=positive_int, default=10, help="denoising steps (default 10)")
    parser.add_argument("--size", type=positive_int, default=512, help="image height = width in pixels (default 512)")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=1.0,
        help="guidance scale: CFG (> 1 runs cond + uncond rows), or FLUX.1 [dev]'s guidance embedding",
    )
    parser.add_argument(
        "--true-cfg-scale",
        type=float,
        default=1.0,
        help="true CFG on a guidance-distilled model (FLUX): > 1 runs cond + uncond rows (default 1)",
    )
    parser.add_argument(
        "--noise-level", type=float, default=0.7, help="SDE noise level of the engine's steps (default 0.7)"
    )
    parser.add_argument("--seed", type=seed_int, default=0, help="seed of the first sample (sample j: seed + j)")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu), bfloat16, float32, float16"
    )
    parser.add_argument(
        "--num-layers",
        type=positive_int,
        default=None,
        help="build a published architecture with this many blocks of each kind (smoke tests of the published widths)",
    )
    add_report_arguments(parser)


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every bench shares: the matmul-peak run its MFU is measured against, and its
    JSON report."""
    parser.add_argument("--peak-seconds", type=float, default=3.0, help="duration of the sustained matmul-peak run")
    parser.add_argument("--json", default=None, help="write the results here (rewritten after every measurement)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --json file (refused otherwise)")


def add_compile_arguments(parser: argparse.ArgumentParser, compile_help: str) -> None:
    parser.add_argument("--compile", action="store_true", help=compile_help)
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend (inductor; eager/aot_eager for tests)"
    )


def build_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{rollout,train,learn}", required=True)
    rollout = sub.add_parser(
        "rollout", help="img/s of the engine (batched, concurrent) vs the diffusers pipeline (batch N, batch 1)"
    )
    add_common_arguments(rollout)
    rollout.add_argument("-n", "--num-samples", type=positive_int, default=16, help="samples per mode (default 16)")
    rollout.add_argument("--height", type=positive_int, default=None, help="sample height in pixels (default: --size)")
    rollout.add_argument("--width", type=positive_int, default=None, help="sample width in pixels (default: --size)")
    rollout.add_argument(
        "--num-frames",
        type=positive_int,
        default=1,
        help="frames per sample: 1 for images; 4k+1 for a video model (Wan)",
    )
    rollout.add_argument(
        "--modes",
        default=None,
        help="comma list of pipeline-serial, pipeline-batched, engine-batched, engine-concurrent, "
        "engine-batched-compiled, engine-concurrent-compiled, pipeline-batched-compiled "
        "(default: the four eager modes, plus the compiled engine modes with --compile)",
    )
    add_compile_arguments(rollout, "also run the engine modes with regional torch.compile")
    rollout.add_argument(
        "--serial-samples", type=positive_int, default=None, help="images of pipeline-serial (default: -n)"
    )
    rollout.add_argument("--repeats", type=positive_int, default=1, help="timed runs per mode; the median is reported")
    rollout.add_argument("--warmup-steps", type=positive_int, default=2, help="steps of each mode's warm-up run")
    rollout.add_argument(
        "--max-batch-rows", type=int, default=0, help="engine max_batch_rows (0: all rows of -n samples)"
    )
    rollout.add_argument(
        "--decode-chunk-size", type=positive_int, default=16, help="most samples VAE-decoded at once (engine)"
    )
    rollout.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="roll out with a LoRA adapter of this rank on the attention projections, as training "
        "does (default 0: the base model, as the targets are stated)",
    )
    train = sub.add_parser(
        "train",
        help="a recipe's whole training step: phases against their FLOP limits, a peer's loop, a projection",
    )
    train.add_argument("--config", required=True, metavar="F", help="YAML recipe (see recipes/)")
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, as `flowrl train` takes them, e.g. model.path=random:qwen-image "
        "reward.name=jpeg_compressibility data.train_path=null trainer.prompts_per_step=2",
    )
    train.add_argument(
        "--steps", type=positive_int, default=3, help="timed training steps after the warm-up step (default 3)"
    )
    train.add_argument(
        "--peer-steps",
        type=int,
        default=None,
        help="timed steps of the peer's loop after its warm-up (0: no peer; default: 1 for FlowGRPO and its "
        "variants, 0 for the forward-process algorithms, which have no peer loop here)",
    )
    train.add_argument(
        "--project-gpus", type=positive_int, default=8, help="GPUs of the projection's second figure (default 8)"
    )
    add_report_arguments(train)
    learn = sub.add_parser(
        "learn",
        help="held-out accuracy against steps and device-seconds: configurations side by side, each with a control",
    )
    add_learn_arguments(learn)


def add_learn_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="F", help="YAML recipe every run starts from")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="overrides for every run, applied before each --run's own"
    )
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="'NAME: KEY=VALUE ...'",
        help="a configuration: a name and its overrides (repeatable; default: the recipe as it is, named flowgrpo)",
    )
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps of every run")
    parser.add_argument(
        "--eval-every", type=positive_int, default=None, help="steps between evaluations (default: steps / 3)"
    )
    parser.add_argument(
        "--seconds",
        type=positive_float,
        default=None,
        help="a budget per configuration: stop training after this many device-seconds (or --steps), score "
        "that step too; its control trains the same number of steps",
    )
    parser.add_argument(
        "--prompts", default=None, metavar="FILE", help="held-out prompts (default: the recipe's data.val_path)"
    )
    parser.add_argument(
        "--eval-prompts", type=positive_int, default=None, help="evaluate the first N prompts (default: all)"
    )
    parser.add_argument("--eval-seeds", type=positive_int, default=2, help="samples (seeds) per held-out prompt")
    parser.add_argument(
        "--train-seeds",
        default=None,
        help="comma-separated training seeds, e.g. 42,1,2: every --run trained at each (NAME@sS, trainer.seed "
        "and rollout.seed set), and one comparison pooled over them (flowrl.bench.learn_seeds)",
    )
    parser.add_argument("--no-control", action="store_true", help="skip the shuffled-advantage control runs")
    parser.add_argument(
        "--controls-only", action="store_true", help="measure only the control runs (not with --seconds)"
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="measure the runs in up to this many processes at once, sharing the device (a configuration and "
        "its control each in its own, but together under --seconds); one joined report",
    )
    parser.add_argument("--out", default="outputs/bench-learn", help="folder for learn.json, learn.png and the runs")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out flowrl did not write")


def run(args) -> int:
    import sys

    from flowrl.output_paths import OutputExistsError, check_output_file

    if args.bench_command == "learn":
        from flowrl.bench.learn import run_learn

        return run_learn(args)
    try:
        if args.json:
            check_output_file(args.json, args.overwrite)
    except OutputExistsError as error:
        print(f"flowrl bench {args.bench_command}: error: {error}", file=sys.stderr)
        return 2
    if args.bench_command == "train":
        from flowrl.bench.train import run_train

        return run_train(args)
    from flowrl.bench.rollout import run_rollout

    return run_rollout(args)
