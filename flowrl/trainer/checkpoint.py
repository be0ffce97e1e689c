"""Checkpoints that restore a run exactly: weights, optimizer, step, data position and RNG.

Layout of `<output_dir>/checkpoints/step_000010/` (safetensors + JSON only, never pickle):
- `trainable.safetensors`  the trainable parameters by name (LoRA weights, or the full transformer)
- `optimizer.safetensors`  every tensor of the optimizer state, keyed `<param name>.<state key>`
- `rng.safetensors`        torch CPU (and CUDA) generator states
- `ema.safetensors`        with `trainer.ema`: the moving average of the trainable parameters, with
                           the keys of `trainable.safetensors` (its meta in state.json, "ema")
- `lora/`                  the LoRA in diffusers format (`pipe.load_lora_weights(dir)`), when LoRA
- `state.json`             step, policy version, data position, optimizer hyper-parameters, Python
                           and numpy RNG states, and the run's config. Written last: a checkpoint
                           folder without it is incomplete and ignored.

A checkpoint is written to a temporary folder and renamed into place, so a crash mid-write never
leaves a folder that looks complete. It knows parameters by name, the optimizer and the RNGs;
what the trainer's own state means (the `state.json` entries it passes) it leaves to the trainer.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flowrl.trainer.lora import has_lora, load_trainable_state_dict, save_lora_for_diffusers, trainable_state_dict

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under output_dir, or None."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / "state.json").is_file()
    ]
    return max(found)[1] if found else None


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """trainer.resume: "auto" (latest in output_dir, None if there is none), "never", or a path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise ValueError(
            f"trainer.resume={resume!r} is not a complete checkpoint folder (no state.json); use 'auto', "
            f"'never' or a folder like {checkpoint_dir(output_dir, 10)}"
        )
    return path


# --- optimizer state as tensors + JSON ---------------------------------------------------------


def _optimizer_to_files(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{names[index]}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{names[index]}.{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars, "param_names": names}


def _optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict, meta: dict, names: list[str]) -> None:
    if meta["param_names"] != names:
        raise ValueError(
            "the checkpoint's optimizer was built over different parameters; resume with the "
            "same trainer.lora settings the checkpoint was written with"
        )
    index_of = {name: i for i, name in enumerate(names)}
    state: dict[int, dict] = {}
    for source in (tensors, meta["scalars"]):
        for key, value in source.items():
            name, _, field = key.rpartition(".")
            state.setdefault(index_of[name], {})[field] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# --- RNG ---------------------------------------------------------------------------------------


def _rng_to_files() -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return tensors, {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }


def _rng_from_files(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# --- save / load -------------------------------------------------------------------------------


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    adapter,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    trainer_state: dict,
    config: dict | None = None,
    ema=None,
) -> Path:
    """Write the checkpoint of `step` (see the module docstring); returns its folder.
    ema: a flowrl.trainer.ema.ParameterEMA to save beside the weights (None: none)."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    transformer = adapter.transformer
    save_file(
        {k: v.cpu().contiguous() for k, v in trainable_state_dict(transformer).items()},
        str(tmp / "trainable.safetensors"),
    )
    opt_tensors, opt_meta = _optimizer_to_files(optimizer, param_names)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    rng_tensors, rng_meta = _rng_to_files()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    if has_lora(transformer) and hasattr(adapter, "pipeline"):
        save_lora_for_diffusers(adapter, tmp / "lora")
    state = {"step": step, "trainer": trainer_state, "optimizer": opt_meta, "rng": rng_meta, "config": config}
    if ema is not None:
        ema_tensors, state["ema"] = ema.state_dict()
        save_file(ema_tensors, str(tmp / "ema.safetensors"))
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_checkpoint(
    path: str | Path,
    transformer: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    ema=None,
) -> dict:
    """Restore weights, optimizer and RNG (and `ema`'s averages, when given and saved) from `path`;
    return {"step", "trainer", "config", "ema_restored"}."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    device = next(transformer.parameters()).device
    load_trainable_state_dict(transformer, load_file(str(path / "trainable.safetensors"), device=str(device)))
    _optimizer_from_files(
        optimizer, load_file(str(path / "optimizer.safetensors"), device=str(device)), state["optimizer"], param_names
    )
    _rng_from_files(load_file(str(path / "rng.safetensors")), state["rng"])
    ema_restored = ema is not None and "ema" in state
    if ema_restored:
        ema.load_state_dict(load_file(str(path / "ema.safetensors"), device=str(device)), state["ema"])
    return {
        "step": state["step"],
        "trainer": state["trainer"],
        "config": state.get("config"),
        "ema_restored": ema_restored,
    }
