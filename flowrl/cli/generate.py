"""`flowrl generate`: sample images with the rollout engine, from a base model or trained weights.

    flowrl generate --model ./tiny-sd3 --prompt "a photo of a cat" -n 8 --out ./samples
    flowrl generate --model /models/sd35m --lora outputs/run/final/lora --prompt "a sign" --out ./samples
    flowrl generate --run outputs/run --prompts data/ocr_val.jsonl --out ./samples   # the run's newest weights

Sampling goes through the agent loop's validation path: image k (prompt-major: prompt i, sample j
is k = i * n + j) gets the seed validation row k gets for `rollout.val_seed = --seed`, and the
settings are `rollout.val_sampling` of the config (--config, else the run's saved config with
--run / --checkpoint / a LoRA inside a run) unless a flag overrides them. So the validation prompts
of a run, with its weights, give exactly its validation images. Writes one PNG per image (an mp4
per video of a video model: `--num-frames`, `--fps`) and stats.json (the engine's batching
counters); prints where the images went and how they batched.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import get_args

from flowrl.cli import positive_int, seed_int
from flowrl.eval.inference import add_model_arguments
from flowrl.sampling_params import SdeType

# flag -> the SamplingParams field it overrides
SAMPLING_FLAGS = {
    "height": "height",
    "width": "width",
    "steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "true_cfg_scale": "true_cfg_scale",
    "negative_prompt": "negative_prompt",
    "noise_level": "noise_level",
    "sde_type": "sde_type",
    "num_frames": "num_frames",
}


def build_parser(parser) -> None:
    add_model_arguments(parser, run_help="a run's output_dir: its newest weights (final/ or the latest checkpoint)")
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for several prompts)")
    parser.add_argument("--prompts", metavar="FILE", help="a prompt file (.txt, .jsonl, .parquet), after any --prompt")
    parser.add_argument("-n", "--num-outputs", type=positive_int, default=1, help="samples per prompt")
    parser.add_argument(
        "--out",
        required=True,
        help="output folder for the PNGs (mp4s) and stats.json: new, empty, or one generate wrote",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out folder that flowrl generate did not write (same-named files are "
        "replaced, nothing else is deleted)",
    )
    sampling = [
        ("--height", positive_int, "image height in pixels", "512, or 64 for tiny models"),
        ("--width", positive_int, "image width in pixels", "512, or 64 for tiny models"),
        ("--steps", positive_int, "denoising steps", "10, or 6 for tiny models"),
        (
            "--guidance-scale",
            float,
            "the model's guidance: CFG (> 1 runs cond and uncond rows), or FLUX.1 [dev]'s guidance embedding",
            "1.0",
        ),
        (
            "--true-cfg-scale",
            float,
            "true CFG on a guidance-distilled model (FLUX.1 [dev]; > 1 adds uncond rows)",
            "1.0",
        ),
        ("--negative-prompt", str, "text of the uncond row under CFG", "the empty string"),
        ("--noise-level", float, "SDE noise level; 0 samples the ODE (deterministic)", "0"),
        ("--sde-type", str, "the stochastic step for --noise-level > 0", "sde"),
        ("--num-frames", positive_int, "frames of a video model's samples (4k+1 for Wan)", "1"),
    ]
    for flag, kind, what, fallback in sampling:
        parser.add_argument(
            flag,
            type=kind,
            choices=get_args(SdeType) if flag == "--sde-type" else None,
            help=f"{what} (default: the config's rollout.val_sampling; without a config {fallback})",
        )
    parser.add_argument(
        "--seed", type=seed_int, help="base seed, as rollout.val_seed (default: the config's rollout.val_seed, 0)"
    )
    parser.add_argument(
        "--max-batch-rows", type=positive_int, help="most rows per forward (default: engine.max_batch_rows, 32)"
    )
    parser.add_argument("--fps", type=positive_int, default=16, help="frame rate of a video model's mp4s (default: 16)")


def _sampling(args, setup):
    """The config's validation sampling with the flags' overrides, validated for the engine and
    against the model family's guidance rule and the rows a forward holds, before the model loads."""
    from flowrl.models.base import check_frames, check_guidance
    from flowrl.models.registry import FAMILIES, read_model_family

    params = setup.cfg.rollout.val_sampling
    changes = {field: getattr(args, flag) for flag, field in SAMPLING_FLAGS.items() if getattr(args, flag) is not None}
    params = params.replace(**changes, logprobs=False)  # generate keeps images only
    family = read_model_family(setup.model_path)
    adapter_class = next(adapter for name, adapter in FAMILIES.values() if name == family)
    kind = adapter_class.guidance_kind
    flags = {field: "--" + flag.replace("_", "-") for flag, field in SAMPLING_FLAGS.items()}
    try:
        params = params.validate(size_multiple=16)
        check_guidance(kind, params)
        check_frames(adapter_class.frame_factor, params)
    except ValueError as error:
        message = str(error)
        for field, flag in flags.items():
            message = message.replace(f"SamplingParams.{field}=", f"{flag} ").replace(f"{field}=", f"{flag} ")
        raise ValueError(message) from None
    field = "true_cfg_scale" if kind == "distilled" else "guidance_scale"  # the uncond row's scale
    rows = setup.cfg.engine.max_batch_rows
    if getattr(params, field) > 1 and rows < 2:
        flag = "--max-batch-rows" if args.max_batch_rows is not None else "engine.max_batch_rows"
        raise ValueError(
            f"{flags[field]} {getattr(params, field)} runs CFG, two rows per sample, but {flag} {rows} fits one; "
            f"use --max-batch-rows 2 or more, or {flags[field]} 1"
        )
    return params


def _rows(args, prompt_field: str) -> list[dict]:
    from flowrl.data.prompts import load_prompt_rows

    rows = [
        {"raw_prompt": text, "negative_prompt": None, "ground_truth": None, "data_source": "default"}
        for text in args.prompt
    ]
    if args.prompts:
        rows += load_prompt_rows(args.prompts, prompt_field, field_name="--prompts")
    if not rows:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts FILE")
    if any(not row["raw_prompt"].strip() for row in rows):
        raise ValueError("--prompt '' is empty; give the text to draw")
    return rows


def run(args) -> int:
    from flowrl.eval.inference import open_engine, resolve_setup, weight_sources
    from flowrl.output_paths import check_output_folder, prepare_output_folder, write_marker

    try:
        check_output_folder(args.out, "generate", args.overwrite)  # before anything is loaded
        sources = weight_sources(args, every_step=False)
        setup = resolve_setup(args, sources)
        rows = _rows(args, setup.cfg.data.prompt_field)
        if args.max_batch_rows is not None:
            setup.cfg.engine.max_batch_rows = args.max_batch_rows
        params = _sampling(args, setup)
        seed = setup.cfg.rollout.val_seed if args.seed is None else args.seed
        engine, loader = open_engine(setup, sources)
        for source in sources:
            loader.load(source)
    except ValueError as error:
        print(f"flowrl generate: error: {error}", file=sys.stderr)
        return 2
    weights = f"{sources[0].label} ({sources[0].path}) on " if sources else ""
    print(f"flowrl generate: {weights}{setup.model_path}; settings from {setup.origin}")
    try:
        out_dir = prepare_output_folder(args.out, "generate", args.overwrite)  # a previous generate's files go
        written, elapsed = _write_images(engine, rows, args.num_outputs, params, seed, out_dir, args.fps)
    finally:
        engine.shutdown()
    stats = engine.stats()
    info = {
        "wall_seconds": elapsed,
        "model": str(setup.model_path),
        "weights": None if not sources else {"label": sources[0].label, "path": str(sources[0].path)},
        "sampling": dataclasses.asdict(params),
        "seed": seed,
        **stats,
        "images": written,
    }
    (out_dir / "stats.json").write_text(json.dumps(info, indent=2))
    write_marker(out_dir, "generate", [Path(name).name for name in written] + ["stats.json"])
    print(f"wrote {len(written)} images to {args.out} in {elapsed:.2f}s")
    print(
        f"forwards {stats['num_forwards']}, rows {stats['num_rows']}, mean rows/forward "
        f"{stats['mean_rows_per_forward']:.2f}, rows-per-forward histogram {stats['rows_per_forward_hist']}, "
        f"{stats['images_per_second']:.2f} img/s"
    )
    return 0


def _write_images(engine, rows, num_outputs, params, seed, out_dir: Path, fps: int = 16) -> tuple[list[str], float]:
    """One PNG per image, or one mp4 per video (H.264 at `fps`), named by prompt index, sample
    index and seed; (paths, seconds)."""
    from PIL import Image

    from flowrl.data.video_files import encode_mp4
    from flowrl.eval.inference import sample_rows

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    written = []
    for first, images, seeds in sample_rows(engine, rows, num_outputs, params, seed):
        for k, (image, sample_seed) in enumerate(zip(images, seeds)):
            stem = out_dir / f"p{first + k // num_outputs:03d}_s{k % num_outputs:03d}_seed{sample_seed}"
            if image.ndim == 4:  # (F, 3, H, W): a video model's sample
                path = stem.with_suffix(".mp4")
                path.write_bytes(encode_mp4(image, fps))
            else:
                path = stem.with_suffix(".png")
                Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)
            written.append(str(path))
    return written, time.perf_counter() - start
