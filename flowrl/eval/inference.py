"""A model ready to sample, for `flowrl eval` and `flowrl generate`: their shared flags, the
settings, the engine with trained weights, and sampling prompt rows as validation does.

- `add_model_arguments(parser)`: --model, one of --lora / --transformer / --checkpoint / --run,
  --ema, --config, KEY=VALUE overrides, --device, --dtype, --compile.
- `weight_sources(args, every_step)`: the flowrl.eval.weights sources those flags name.
- `resolve_setup(args, sources)`: the settings (--config, else the run's saved config, also when
  --model is a run's final/, else the defaults sized for the model; overrides last), the base
  model folder, device and dtype.
- `open_engine(setup, sources)`: the adapter loaded, the LoRA the sources need injected, then
  compiled when configured (as the trainer does), under the trainer's mixed precision and engine
  settings (flowrl.run.checks.engine_options: batch limits, the prompt cache).
- `sample_rows(engine, rows, ...)`: every row's images through the agent loop's validation path,
  with validation's seeds (row k of the prompt list gets the seed validation row k gets), so the
  images of a run's validation prompts are the run's validation images.

It knows configs, engines and weight sources, nothing about rewards or reports.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from flowrl.eval.weights import (
    WeightSource,
    check_model_folder,
    checkpoint_source,
    lora_source,
    run_sources,
    transformer_source,
)
from flowrl.run.export import read_run_info

TINY_TRANSFORMER_PARAMETERS = 10_000_000  # below this a checkpoint is a tiny test model
DEFAULTS = "the defaults"  # Setup.origin without a recipe or a run


def add_model_arguments(parser: argparse.ArgumentParser, run_help: str) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="the base model, a local diffusers pipeline folder (default: model.path of --config or of the "
        "run's saved config)",
    )
    weights = parser.add_argument_group("trained weights (at most one)").add_mutually_exclusive_group()
    weights.add_argument("--lora", metavar="DIR", help="a diffusers LoRA folder, e.g. a run's final/lora")
    weights.add_argument("--transformer", metavar="DIR", help="a transformer folder, e.g. a run's final/transformer")
    weights.add_argument("--checkpoint", metavar="DIR", help="a training checkpoint, e.g. RUN/checkpoints/step_000020")
    weights.add_argument("--run", metavar="DIR", help=run_help)
    parser.add_argument(
        "--ema", action="store_true", help="with --checkpoint / --run: the checkpoints' EMA weights (ema.safetensors)"
    )
    parser.add_argument(
        "--config",
        metavar="F",
        help="YAML recipe for the settings (default: the run's saved config with --run, --checkpoint or a LoRA "
        "inside a run, else the defaults)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides applied last, e.g. rollout.val_sampling.num_inference_steps=20 rollout.val_seed=3",
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: the config's model.device, auto)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (default: the config's model.dtype with --config or a run, else bfloat16 on a GPU, "
        "float32 on CPU)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="regional torch.compile with flowrl's fast paths (default: the config's engine.compile with --config "
        "or a run, else off)",
    )


def weight_sources(args: argparse.Namespace, every_step: bool) -> list[WeightSource]:
    """The weights the flags name, base not included; with --run every saved step (every_step) or
    the newest one."""
    if args.ema and not (args.checkpoint or args.run):
        raise ValueError("--ema reads a checkpoint's ema.safetensors; use it with --checkpoint or --run")
    if args.lora:
        return [lora_source(args.lora)]
    if args.transformer:
        return [transformer_source(args.transformer)]
    if args.checkpoint:
        return [checkpoint_source(args.checkpoint, args.ema)]
    if args.run:
        sources = run_sources(args.run, args.ema)
        return sources if every_step else sources[-1:]
    return []


@dataclass
class Setup:
    """What sampling needs besides the weights. `origin` says where the settings came from."""

    cfg: object  # flowrl.config.FlowRLConfig
    origin: str
    model_path: Path
    device: str
    dtype: str
    compile: bool


def _tiny(model_path: Path) -> bool:
    from flowrl.models.debug.tiny import parameter_counts

    return parameter_counts(model_path).get("transformer", 0) < TINY_TRANSFORMER_PARAMETERS


def resolve_setup(args: argparse.Namespace, sources: list[WeightSource]) -> Setup:
    """The settings and the base model (module docstring); ValueError naming the flag at fault."""
    from flowrl.config import config_from_dict, load_config
    from flowrl.config.sections import is_device_name, resolve_device
    from flowrl.run.checks import check_cuda_device

    overrides = list(args.overrides)
    saved = next((s for s in reversed(sources) if s.config is not None), None)
    final_info = read_run_info(args.model) if args.model and saved is None else None  # --model RUN/final
    if args.config:
        cfg, origin = load_config(args.config, overrides), f"--config {args.config}"
    elif saved is not None:
        cfg, origin = config_from_dict(saved.config, overrides, saved=True), f"the run's saved config ({saved.path})"
    elif final_info is not None and final_info.get("config"):
        cfg, origin = (
            config_from_dict(final_info["config"], overrides, saved=True),
            f"the run's saved config ({args.model})",
        )
    else:
        cfg, origin = load_config(None, overrides), DEFAULTS
    if args.model:
        model_path = check_model_folder(args.model, "--model")
    elif cfg.model.path:
        model_path = check_model_folder(cfg.model.path, "model.path (pass --model to use another)")
    elif saved is not None:  # a run of the embedded tiny model (model.path unset)
        model_path = _embedded_model(saved, cfg.model)
    else:
        raise ValueError("--model is required: pass the base model's local diffusers folder (or --run DIR of a run)")
    if origin == DEFAULTS and not _tiny(model_path):
        # No recipe and no run: sampling sized for a real model (the defaults are the tiny run's).
        sized = ["height=512", "width=512", "num_inference_steps=10"]
        sections = ("rollout.sampling", "rollout.val_sampling")  # `flowrl serve` defaults to both
        cfg = load_config(None, [*(f"{section}.{item}" for section in sections for item in sized), *overrides])
    device = args.device or cfg.model.device
    if not is_device_name(device):
        raise ValueError(f"--device {device!r} is invalid; use auto, cpu, cuda or cuda:N")
    device = resolve_device(device)
    check_cuda_device(device, "--device " if args.device else "model.device=", "--device cpu or auto")
    if args.dtype:
        dtype = args.dtype
    elif origin != DEFAULTS:
        dtype = cfg.model.dtype
    else:
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    compile_ = args.compile if args.compile is not None else (cfg.engine.compile and origin != DEFAULTS)
    return Setup(cfg, origin, model_path, device, dtype, bool(compile_))


def _embedded_model(source: WeightSource, model_cfg) -> Path:
    """The embedded tiny model a run of it trained (its saved model.path is unset): the base folder
    its final/ names when that still exists; else the tiny model's folder, built there if missing
    (from seed 0: the same bytes the run trained), saying where: the run may have been started in
    another folder, whose tiny model this one is not."""
    from flowrl.console import note
    from flowrl.run.checks import resolve_model_path, tiny_model_cache_dir

    for folder in (source.path, *source.path.parents[:2]):  # final/X, RUN/final, checkpoints/step_N
        info = read_run_info(folder if folder.name == "final" else folder / "final")
        base = (info or {}).get("base_model")
        if base and (Path(base) / "model_index.json").is_file():
            return Path(base)
    existed = (tiny_model_cache_dir() / "model_index.json").is_file()
    path = resolve_model_path(model_cfg)
    if not existed:
        note(
            f"the run trained the embedded tiny SD3 model (model.path unset) and names no folder of it that still "
            f"exists; built it in {path} (from seed 0, the same bytes the run trained; $FLOWRL_CACHE moves it)"
        )
    return Path(path)


def open_engine(setup: Setup, sources: list[WeightSource]):
    """(engine, WeightLoader) over the base model with the sources' LoRA injected (module docstring)."""
    import torch

    from flowrl.engine.engine import DiffusionEngine
    from flowrl.eval.weights import WeightLoader
    from flowrl.models.base import MIXED_PRECISION_DTYPES
    from flowrl.models.registry import load_adapter
    from flowrl.run.checks import engine_options

    adapter = load_adapter(
        setup.model_path, device=setup.device, dtype=getattr(torch, setup.dtype), **setup.cfg.model.adapter_options()
    )
    loader = WeightLoader(adapter)
    loader.prepare(sources)
    engine = DiffusionEngine(adapter, **engine_options(setup.cfg.engine), compile=setup.compile)
    engine.set_mixed_precision(MIXED_PRECISION_DTYPES[setup.cfg.trainer.mixed_precision])
    return engine, loader


def sample_rows(engine, rows: list[dict], samples_per_prompt: int, params, base_seed: int):
    """Yield (first row index, images (n * samples_per_prompt, 3, H, W) uint8, seeds) chunk by
    chunk: sample j of row i is validation row i * samples_per_prompt + j (same seed, same
    sampling path), so a run's validation prompts give its validation images. Chunks bound the
    trajectories held in memory while keeping every forward full."""
    from flowrl.config.sections import RolloutConfig
    from flowrl.rollout.agent_loop import AgentLoop, row_seed
    from flowrl.rollout.batch import RolloutBatch

    loop = AgentLoop(engine, RolloutConfig(n=samples_per_prompt, val_seed=base_seed, val_sampling=params))
    rows_per_chunk = max(1, 4 * engine.max_batch_rows // samples_per_prompt)
    for start in range(0, len(rows), rows_per_chunk):
        repeated = [
            {**row, "seed": row_seed(base_seed, (start + i) * samples_per_prompt + j)}
            for i, row in enumerate(rows[start : start + rows_per_chunk])
            for j in range(samples_per_prompt)
        ]
        out = loop.generate_sequences(RolloutBatch.from_rows(repeated), validation=True)
        yield start, out.batch["images"], [int(seed) for seed in out.non_tensor_batch["seed"]]


def describe_sampling(params, base_seed: int) -> str:
    """One line: how the images are sampled."""
    kind = "ODE" if params.noise_level == 0 else f"{params.sde_type.upper()} noise_level={params.noise_level}"
    return (
        f"{kind}, {params.num_inference_steps} steps, {params.height}x{params.width}, guidance "
        f"{params.guidance_scale}, seeds from rollout.val_seed={base_seed}"
    )
