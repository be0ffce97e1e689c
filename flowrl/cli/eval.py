"""`flowrl eval`: score a base model and its trained weights on a prompt file, same seeds for all.

    flowrl eval --model /models/sd35m --lora outputs/run/final/lora --prompts data/ocr_val.jsonl --reward ocr
    flowrl eval --run outputs/run --prompts data/ocr_val.jsonl          # every saved step, the run's reward
    flowrl eval --model M --config recipes/sd35_medium_ocr_lora.yaml --prompts F --reward ocr --reward pickscore

Sampling is the config's `rollout.val_sampling` (ODE: deterministic) with seeds from
`rollout.val_seed`; the config is --config, else the run's saved config, else the defaults (sized
for the model); KEY=VALUE overrides apply last. The base model is always evaluated first, so every
trained source is compared with it on the same seeds. Writes OUT/eval_report.json, OUT/grid.png
and OUT/images/<weights>/*.png, and prints a table. Bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from flowrl.cli import positive_int
from flowrl.eval.inference import add_model_arguments


def build_parser(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, run_help="a run's output_dir: every saved checkpoint, then final/ when newer")
    parser.add_argument("--prompts", required=True, metavar="FILE", help="prompt file: .txt, .jsonl or .parquet")
    parser.add_argument("--prompt-field", help="the prompt column of a .jsonl/.parquet (default: data.prompt_field)")
    parser.add_argument("--max-prompts", type=positive_int, help="evaluate the first N prompts only (default: all)")
    parser.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="NAME",
        help="a registered reward (repeatable; default: the config's reward section, e.g. the run's own)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="an option of reward NAME; VALUE is parsed as JSON when it can be (repeatable)",
    )
    parser.add_argument("-n", "--samples-per-prompt", type=positive_int, default=1, help="seeds per prompt")
    parser.add_argument(
        "--out",
        default="outputs/eval",
        help="folder for the report, the grid and the images: new, empty, or one eval wrote (its files are replaced)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out folder that flowrl eval did not write (nothing of it is deleted)",
    )
    parser.add_argument(
        "--grid-rows", type=int, default=8, help="(prompt, sample) rows of grid.png, from the first prompt; 0: none"
    )


def build_rewards(names: list[str], options: list[str], reward_cfg) -> dict:
    """{column name: Reward}: each --reward with its --option NAME.KEY=VALUE, or the config's reward."""
    from flowrl.cli.reward_score import parse_option
    from flowrl.rewards import build_reward, build_reward_from_config

    per_reward: dict[str, dict] = {name: {} for name in names}
    for text in options:
        key, value = parse_option(text)
        name, _, option = key.partition(".")
        if name not in per_reward or not option:
            raise ValueError(f"--option {text!r} must be NAME.KEY=VALUE with NAME one of the --reward names {names}")
        per_reward[name][option] = value
    if names:
        return {name: build_reward({"name": name, "options": opts}) for name, opts in per_reward.items()}
    return {reward_cfg.name or "reward": build_reward_from_config(reward_cfg)}


def run(args: argparse.Namespace) -> int:
    from flowrl.data.prompts import load_prompt_rows
    from flowrl.eval.evaluate import evaluate, summarize
    from flowrl.eval.inference import describe_sampling, open_engine, resolve_setup, weight_sources
    from flowrl.eval.report import GRID_FILE, build_report, format_table, save_comparison_grid, write_report
    from flowrl.eval.weights import BASE
    from flowrl.output_paths import check_output_folder, prepare_output_folder, write_marker
    from flowrl.rewards import RewardError
    from flowrl.rewards.base import check_rows

    try:
        check_output_folder(args.out, "eval", args.overwrite)  # before anything is loaded
        if args.grid_rows < 0:
            raise ValueError(f"--grid-rows {args.grid_rows} must be >= 0")
        sources = [BASE, *weight_sources(args, every_step=True)]
        setup = resolve_setup(args, sources)
        field = args.prompt_field or setup.cfg.data.prompt_field
        rows = load_prompt_rows(args.prompts, field, args.max_prompts, "--prompts")
        rewards = build_rewards(args.reward, args.option, setup.cfg.reward)
        for reward in rewards.values():
            check_rows(reward, rows, f"--prompts {str(args.prompts)!r}")
        params, seed = setup.cfg.rollout.val_sampling, setup.cfg.rollout.val_seed
        engine, loader = open_engine(setup, sources)
    except ValueError as error:
        print(f"flowrl eval: error: {error}", file=sys.stderr)
        return 2
    sampling = describe_sampling(params, seed)
    print(
        f"flowrl eval: {len(rows)} prompts x {args.samples_per_prompt} sample(s), {len(sources)} weight sets on "
        f"{setup.model_path}; {sampling}; settings from {setup.origin}",
        flush=True,
    )
    try:
        out = prepare_output_folder(args.out, "eval", args.overwrite)  # a previous eval's files go
        results = evaluate(
            engine,
            loader,
            sources,
            rows,
            rewards,
            params,
            seed,
            args.samples_per_prompt,
            out / "images",
            args.grid_rows,
            progress=lambda source: print(f"  sampling {source.label}", flush=True),
        )
    except (ValueError, RewardError) as error:
        print(f"flowrl eval: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    finally:
        engine.shutdown()
    summary = summarize(results)
    settings = {
        "model": str(setup.model_path),
        "prompts": str(args.prompts),
        "num_prompts": len(rows),
        "samples_per_prompt": args.samples_per_prompt,
        "settings_from": setup.origin,
        "sampling": {**dataclasses.asdict(params), "description": sampling},
        "val_seed": seed,
        "dtype": setup.dtype,
        "mixed_precision": setup.cfg.trainer.mixed_precision,
        "rewards": list(results[0].scores),
        "interval": "95% normal approximation over prompts (per prompt: the mean of its samples)",
    }
    grid = save_comparison_grid(results, rows, args.samples_per_prompt, out / GRID_FILE)
    report = write_report(
        out, build_report({**settings, "grid": None if grid is None else str(grid)}, rows, results, summary)
    )
    written = [os.path.relpath(path, out) for result in results for path in result.image_paths]
    write_marker(out, "eval", [*written, report.name, *([] if grid is None else [grid.name])])
    print(format_table(summary))
    print(f"report: {report}" + (f"; grid: {grid}" if grid else "") + f"; images: {out / 'images'}")
    return 0
