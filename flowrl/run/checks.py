"""Everything the trainer checks and builds before training, cheapest and most error-prone first.

`check_before_loading(cfg)` raises ValueError for bad input (missing model path, empty dataset,
a group advantage with n=1, unknown reward, a dataset row the reward cannot score, a KL reference
without LoRA, guidance settings the model family cannot honour, a GPU device on a machine without
one, random weights at a published size on a CPU, a schedule with no step to train, a two-expert
model without the expert to train, an output folder that cannot be written) before any model is
loaded, so mistakes cost seconds, not minutes.
`resolve_model_path` builds the embedded tiny SD3 model when `model.path` is unset;
`model.path=random:NAME` is a published architecture with random weights
(flowrl.models.debug.random_weights), built when the engine loads. `build_engine` loads the model into
the rollout engine as the trainer runs it, with `engine_options`, the config's engine settings
that every engine flowrl opens takes (the trainer's, flowrl eval/generate's, flowrl serve's).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flowrl.config.algorithm_rules import check_training_rollout
from flowrl.data.prompts import load_prompt_rows

TINY_MODEL_DIRNAME = "tiny-sd3"


def tiny_model_cache_dir() -> Path:
    """Where the embedded tiny SD3 checkpoint lives: $FLOWRL_CACHE/tiny-sd3, else ./outputs/tiny-sd3."""
    return Path(os.environ.get("FLOWRL_CACHE", "outputs")) / TINY_MODEL_DIRNAME


def check_model_path(model_cfg) -> Path | str | None:
    """The model folder, or `random:NAME` as it is (None: the embedded tiny model); ValueError
    when it is unusable."""
    from flowrl.models.debug.random_weights import is_random_path
    from flowrl.models.registry import check_model_files, read_model_family

    if model_cfg.path is None:
        if model_cfg.family not in ("auto", "sd3"):
            raise ValueError(
                f"model.family={model_cfg.family!r} but model.path is unset, which means the embedded tiny "
                "SD3 model; set model.path to a local diffusers folder of that family, or model.family=auto"
            )
        return None
    path = model_cfg.path if is_random_path(model_cfg.path) else Path(model_cfg.path)
    if not is_random_path(path) and not path.exists():
        raise ValueError(
            f"model.path={model_cfg.path!r} does not exist; pass a local diffusers folder (written by "
            "save_pretrained or `flowrl make-tiny --kind sd3 OUT`), random:NAME for random weights at a "
            "published architecture, or leave model.path unset for the tiny model"
        )
    family = read_model_family(path)  # raises for a folder that is not a supported pipeline, or an unknown NAME
    check_model_files(path)  # a component missing or truncated
    if model_cfg.family not in ("auto", family):
        raise ValueError(
            f"model.family={model_cfg.family!r} but {path} holds a {family} pipeline; set model.family=auto or {family}"
        )
    return path


def resolve_model_path(model_cfg) -> Path | str:
    """model.path (a folder or `random:NAME`), or the embedded tiny SD3 model (built offline on
    first use)."""
    path = check_model_path(model_cfg)
    if path is not None:
        return path
    from flowrl.models.debug.tiny import build_tiny_checkpoint
    from flowrl.output_paths import OutputExistsError

    folder = tiny_model_cache_dir()
    try:
        return build_tiny_checkpoint("sd3", folder, seed=0)
    except OutputExistsError:
        raise ValueError(
            f"the embedded tiny model's folder {folder} holds files flowrl did not write; move them away, or set "
            "FLOWRL_CACHE to another folder (the tiny model is built in $FLOWRL_CACHE/tiny-sd3)"
        ) from None


def engine_options(engine_cfg) -> dict:
    """The DiffusionEngine settings of the config's `engine` section that every engine flowrl opens
    takes (compiling is each caller's own: the trainer compiles after LoRA injection)."""
    return dict(
        max_batch_rows=engine_cfg.max_batch_rows,
        decode_chunk_size=engine_cfg.decode_chunk_size,
        prompt_cache_mb=engine_cfg.prompt_cache_mb,
    )


def build_engine(cfg, device: str | None = None):
    """The rollout engine over `cfg.model` on `device` (None: model.device), with the engine
    settings the trainer runs (`engine_options`)."""
    from flowrl.engine.engine import DiffusionEngine

    return DiffusionEngine.from_pretrained(
        resolve_model_path(cfg.model),
        device=device or cfg.model.resolve_device(),
        dtype=cfg.model.torch_dtype,
        **engine_options(cfg.engine),
        **cfg.model.adapter_options(),
    )


def check_device(model_cfg) -> None:
    """A `cuda` device must exist on this machine."""
    check_cuda_device(model_cfg.device, "model.device=", "model.device=cpu or auto")


def check_cuda_device(device: str, key: str, cpu_choice: str) -> None:
    """ValueError when `device` names a CUDA GPU this machine does not show; `key` prefixes the
    value in the message ("model.device=", "--device "), `cpu_choice` is the fix without a GPU."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"{key}{device!r} but no CUDA GPU is visible (torch.cuda.is_available() is False); use {cpu_choice}, "
            "or run where a GPU is visible"
        )
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"{key}{device!r} but {count} CUDA GPU(s) are visible; use cuda:0 to cuda:{count - 1}")


def check_random_weights_device(model_cfg) -> None:
    """`model.path=random:NAME` at a published size needs a GPU: built on the CPU it fills tens of
    GB of host memory for minutes, then trains at no useful speed. Says so, with the size, before
    anything is built (the tiny architectures run anywhere)."""
    from flowrl.models.debug.random_weights import (
        architecture_name,
        has_two_random_experts,
        is_random_path,
        published_parameter_count,
        tiny_name,
    )

    if model_cfg.path is None or not is_random_path(model_cfg.path):
        return
    name = architecture_name(model_cfg.path)
    if name.startswith("tiny-") or model_cfg.resolve_device() != "cpu":
        return
    from flowrl.models.debug.architectures import ARCHITECTURES

    count = published_parameter_count(name)
    family = ARCHITECTURES[name][0]
    tiny = f"model.path=random:{tiny_name(family)}"
    if has_two_random_experts(model_cfg.path):
        tiny = f"the tiny two-expert model (flowrl make-tiny --kind {name} OUT, then model.path=OUT)"
    weights_gb = count * {"float32": 4, "bfloat16": 2, "float16": 2}[model_cfg.dtype] / 1e9
    raise ValueError(
        f"model.path={model_cfg.path!r} builds the {name} architecture at its published size with random weights "
        f"({count / 1e9:.1f} B parameters: {weights_gb:.0f} GB in {model_cfg.dtype} for the weights alone, before "
        f"gradients, optimizer states and activations), which needs a GPU, but model.device={model_cfg.device!r} "
        "is the CPU (no CUDA GPU visible); run where a GPU with well over that much memory is visible (the README's "
        f"Hardware table gives each model's needs), or use {tiny} on a CPU"
    )


def check_output_dir(output_dir: str) -> None:
    """trainer.output_dir exists (created here) and accepts a file."""
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise ValueError(
            f"trainer.output_dir={output_dir!r} is not writable ({error.strerror or error}); "
            "choose a folder you can write to"
        ) from None


@dataclass
class Prepared:
    """What the cheap checks produced: prompt rows, validation rows and the reward."""

    train_rows: list[dict]
    val_rows: list[dict]
    reward: object


def check_before_loading(cfg, reward=None) -> Prepared:
    """Validate the config and everything that needs no model; see the module docstring."""
    cfg.validate()
    if cfg.rollout.n < 2:  # also in config.validate; repeated so a hand-built config cannot skip it
        raise ValueError(
            f"rollout.n={cfg.rollout.n} gives groups of one sample, whose advantage is always 0; use rollout.n >= 2"
        )
    check_training_rollout(cfg)
    if cfg.algorithm.kl_beta > 0 and not cfg.trainer.lora.enabled:
        raise ValueError(
            f"algorithm.kl_beta={cfg.algorithm.kl_beta} needs a reference model, which is the LoRA-disabled "
            "transformer; set trainer.lora.enabled=true or algorithm.kl_beta=0"
        )
    check_device(cfg.model)
    check_random_weights_device(cfg.model)
    if cfg.model.offload_text_encoders:
        from flowrl.models.registry import check_text_encoder_offload

        check_text_encoder_offload(cfg.model.path, cfg.model.resolve_device())
    check_output_dir(cfg.trainer.output_dir)
    data = cfg.data
    train_rows = load_prompt_rows(data.train_path, data.prompt_field, data.max_prompts, "data.train_path")
    if data.val_path is not None:
        val_rows = load_prompt_rows(data.val_path, data.prompt_field, None, "data.val_path")
    else:
        val_rows = train_rows
    val_rows = val_rows[: cfg.trainer.num_val_images]
    if reward is None:
        from flowrl.rewards import build_reward_from_config

        reward = build_reward_from_config(cfg.reward)
    check_reward_rows(reward, data, train_rows, val_rows)
    from flowrl.models.registry import model_has_two_experts

    model_path = check_model_path(cfg.model)
    check_guidance_settings(model_path, cfg.rollout)
    check_expert_setting(model_path is not None and model_has_two_experts(model_path), cfg.model)
    return Prepared(train_rows, val_rows, reward)


def prompts_per_step_remark(trainer_cfg, data_cfg, num_rows: int) -> str | None:
    """The line a run prints when a step takes more prompts than the dataset holds (it cycles:
    some prompts twice in one step), else None."""
    if trainer_cfg.prompts_per_step <= num_rows:
        return None
    where = "the built-in prompts" if data_cfg.train_path is None else f"data.train_path={data_cfg.train_path!r}"
    return (
        f"note: trainer.prompts_per_step={trainer_cfg.prompts_per_step} is more than the {num_rows} prompts of "
        f"{where}, so every step takes some prompts more than once (one group each time) and a step spans "
        f"more than one epoch; lower trainer.prompts_per_step to at most {num_rows}, or give more prompts"
    )


def check_reward_rows(reward, data_cfg, train_rows: list[dict], val_rows: list[dict]) -> None:
    """Every training and validation row is one the reward can score (e.g. the OCR reward's
    `ground_truth`), else a ValueError naming the file and row (flowrl.rewards.base.check_rows)."""
    from flowrl.rewards.base import check_rows

    if data_cfg.train_path is None:
        check_rows(reward, train_rows, "the built-in prompts (data.train_path unset)")
    else:
        check_rows(reward, train_rows, f"data.train_path={data_cfg.train_path!r}")
    if data_cfg.val_path is not None:
        check_rows(reward, val_rows, f"data.val_path={data_cfg.val_path!r}")


def check_guidance_settings(model_path: Path | str | None, rollout_cfg) -> None:
    """rollout.sampling and rollout.val_sampling against the guidance rule of the model's family
    (flowrl.models.base.check_guidance: e.g. true_cfg_scale on a classifier-free-guidance model),
    before the model loads, and their num_frames against its frame rule (check_frames: 1 for an
    image model, 4k+1 for Wan). model_path None is the embedded tiny SD3 model."""
    from flowrl.models.base import check_frames, check_guidance
    from flowrl.models.registry import FAMILIES, read_model_family

    family = "sd3" if model_path is None else read_model_family(model_path)
    adapter_class = next(adapter for name, adapter in FAMILIES.values() if name == family)
    for name in ("sampling", "val_sampling"):
        try:
            check_guidance(adapter_class.guidance_kind, getattr(rollout_cfg, name))
            check_frames(adapter_class.frame_factor, getattr(rollout_cfg, name))
        except ValueError as error:
            raise ValueError(str(error).replace("SamplingParams.", f"rollout.{name}.")) from None


def check_expert_setting(has_two_experts: bool, model_cfg) -> None:
    """model.trained_expert against the model's experts: a two-expert model (Wan2.2-A14B) trains
    one of them, which the setting must name; any other model refuses the setting
    (flowrl.models.wan.check_trained_expert)."""
    from flowrl.models.wan import check_trained_expert

    check_trained_expert(model_cfg.trained_expert, has_two_experts, f"model.path={model_cfg.path!r}")
    if has_two_experts and model_cfg.trained_expert is None:
        raise ValueError(
            f"model.path={model_cfg.path!r} has two experts (Wan2.2-A14B: `transformer` predicts the high-noise "
            "steps, `transformer_2` the low-noise ones) and the trainer trains one of them; set "
            "model.trained_expert=high or model.trained_expert=low (docs/video.md)"
        )
