"""A run's `final/` folder: the trained model as a diffusers pipeline folder.

    final/
      model_index.json   the base model's
      scheduler/, vae/, text_encoder*/, tokenizer*/ ...
                         the unchanged components: symlinks to the base model's folders (copies
                         where the filesystem refuses symlinks)
      transformer/       the trained transformer; after LoRA training, the LoRA fused into a copy
                         of the base weights (W + s B A, the function the trained model computes)
      lora/              LoRA runs only: the adapter in diffusers format (`pipe.load_lora_weights`)
      flowrl_run.json    the step, the base model folder, what was trained and the run's config
                         (flowrl eval/generate read it; diffusers ignores it)

so the family's pipeline loads the trained model with `from_pretrained(final)`, and
`flowrl generate --model final` samples it. The folder is written next to its final place and
renamed into it, so an interrupted export never leaves a half-written `final/`.

A two-expert model (Wan2.2-A14B) trains one expert (model.trained_expert): the trained one is
written in its own component's folder, `transformer/` for the high expert and `transformer_2/`
for the low one, the other linked to the base's; the LoRA keeps diffusers' `transformer.` keys,
so a low expert's loads with `pipe.load_lora_weights(lora, load_into_transformer_2=True)`, which
flowrl_run.json spells out (`trained_expert`, `load_lora`).

This module knows the adapter's modules and the diffusers folder layout, nothing about training.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from flowrl.models.lora import adapter_delta, has_lora, save_lora_for_diffusers
from flowrl.models.wan import EXPERT_COMPONENTS

RUN_INFO_FILE = "flowrl_run.json"
TRANSFORMER_WEIGHTS_PATTERN = "diffusion_pytorch_model{suffix}.safetensors"  # diffusers' own names
TRANSFORMER_SHARD_SIZE = "10GB"  # diffusers' default shard size


def export_pipeline(
    adapter, directory: str | Path, step: int, config: dict | None, transformer_state: dict | None = None
) -> Path:
    """Write the pipeline folder of the adapter's current weights to `directory` (see the module
    docstring; an existing folder is replaced). Returns the directory. `transformer_state`: the
    whole weights of a transformer whose module holds only its shard (sharded full fine-tuning
    gathers them first); without it, the module's own weights."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    base = _base_folder(adapter.pipeline)
    trained = adapter.trained_component  # "transformer", or a two-expert model's trained expert's
    # 1. every component but the trained transformer, and the pipeline's index
    if base is not None:
        shutil.copyfile(base / "model_index.json", tmp / "model_index.json")
        for name in _component_names(base / "model_index.json"):
            if name != trained and (base / name).is_dir():
                _link_or_copy(base / name, tmp / name)
    else:  # a pipeline not loaded from a folder: save each component
        adapter.pipeline.save_config(tmp)
        for name, component in adapter.pipeline.components.items():
            if name != trained and component is not None:
                component.save_pretrained(tmp / name)
    # 2. the trained transformer (and the LoRA on its own)
    transformer = adapter.transformer
    lora = has_lora(transformer)
    if lora:
        save_fused_transformer(transformer, tmp / trained)
        save_lora_for_diffusers(adapter, tmp / "lora")
    else:
        save_transformer(transformer, tmp / trained, transformer_state)
    info = {
        "step": step,
        "base_model": None if base is None else str(base),
        "trained": "lora" if lora else "full",
        **_expert_info(adapter, lora),
        "config": config,
    }
    (tmp / RUN_INFO_FILE).write_text(json.dumps(info, indent=1))
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def _expert_info(adapter, lora: bool) -> dict:
    """What flowrl_run.json says of a two-expert model's trained expert, and how its LoRA loads."""
    expert = getattr(adapter, "trained_expert", None)
    if expert is None:
        return {}
    info = {"trained_expert": expert, "trained_component": adapter.trained_component}
    if lora:
        into = ", load_into_transformer_2=True" if adapter.trained_component == EXPERT_COMPONENTS["low"] else ""
        info["load_lora"] = f"pipe.load_lora_weights('lora'{into})"
    return info


def read_run_info(final: str | Path) -> dict | None:
    """The `flowrl_run.json` of a final/ folder, or None when it has none."""
    path = Path(final) / RUN_INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _base_folder(pipeline) -> Path | None:
    """The local folder the pipeline was loaded from (diffusers records it), if it still is one."""
    name = getattr(pipeline, "name_or_path", None)
    if not name or not (Path(name) / "model_index.json").is_file():
        return None
    return Path(name).resolve()


def _component_names(model_index: Path) -> list[str]:
    index = json.loads(model_index.read_text())
    return [name for name, value in index.items() if not name.startswith("_") and isinstance(value, list)]


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        target.symlink_to(source, target_is_directory=True)
    except OSError:  # filesystems (and Windows accounts) without symlinks
        shutil.copytree(source, target)


def fused_transformer_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the plain transformer that computes what the LoRA-adapted one does: every
    LoRA Linear's weight becomes W + s B A (in float32, then the base weight's dtype), the peft
    wrapper names (`base_layer`, `lora_*`) are gone. Tensors on the CPU."""
    fused = {}
    for name, module in transformer.named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            continue
        weight = module.base_layer.weight
        fused[f"{name}.weight"] = (weight.float() + adapter_delta(module)).to(weight.dtype)
    state = {}
    for key, value in transformer.state_dict().items():
        if any(part.startswith("lora_") for part in key.split(".")):
            continue
        plain = key.replace(".base_layer.", ".")
        state[plain] = fused.get(plain, value)
    return {key: value.detach().cpu().contiguous() for key, value in state.items()}


def save_fused_transformer(transformer: torch.nn.Module, directory: str | Path) -> Path:
    """A diffusers model folder (config.json + safetensors shards) of the fused transformer, which
    the model class loads with `from_pretrained`."""
    return _save_state(transformer, fused_transformer_state_dict(transformer), directory)


def save_transformer(transformer: torch.nn.Module, directory: str | Path, state: dict | None = None) -> Path:
    """A diffusers model folder of the (plain) transformer: its own weights, or `state` when given
    (the whole weights of a sharded module, whose own are only its shard)."""
    if state is None:
        transformer.save_pretrained(directory)
        return Path(directory)
    return _save_state(transformer, state, directory)


def _save_state(transformer: torch.nn.Module, state: dict[str, torch.Tensor], directory: str | Path) -> Path:
    from huggingface_hub import save_torch_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _save_model_config(transformer, directory)
    save_torch_state_dict(
        state, directory, filename_pattern=TRANSFORMER_WEIGHTS_PATTERN, max_shard_size=TRANSFORMER_SHARD_SIZE
    )
    return directory


def _save_model_config(transformer: torch.nn.Module, directory: Path) -> None:
    """The model's config.json, naming the model's own class: FSDP2 (`fully_shard`) swaps a sharded
    module's class for a subclass `FSDP<Class>`, which no diffusers loader knows."""
    from torch.distributed.fsdp import FSDPModule

    transformer.save_config(directory)
    if not isinstance(transformer, FSDPModule):
        return
    own = next(cls for cls in type(transformer).__mro__ if not issubclass(cls, FSDPModule))
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["_class_name"] = own.__name__
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # diffusers' own layout
