"""Checkpoints that restore a run exactly: weights, optimizer, step, data position and RNG.

Layout of `<output_dir>/checkpoints/step_000010/` (safetensors + JSON only, never pickle):
- `trainable.safetensors`  the trainable parameters by name (LoRA weights, or the full transformer)
- `optimizer.safetensors`  every tensor of the optimizer state, keyed `<param name>.<state key>`
- `rng.safetensors`        torch CPU (and CUDA) generator states
- `ema.safetensors`        with `trainer.ema`: the moving average of the trainable parameters, with
                           the keys of `trainable.safetensors` (its meta in state.json, "ema")
- `old_policy.safetensors` likewise, an algorithm's own average (DiffusionNFT's old policy)
- `lora/`                  the LoRA in diffusers format (`pipe.load_lora_weights(dir)`), when LoRA
- `sharded/`               in place of the three tensor files above, when the weights are sharded
                           over ranks (FSDP2 full fine-tuning): every rank's shards of the weights,
                           optimizer state and EMA averages in `rank<N>.safetensors`, their index in
                           `index.json`, the optimizer's hyper-parameters in `optimizer.json`
                           (flowrl.distributed.sharded_checkpoint; never torch's pickled `.metadata`)
- `state.json`             step, policy version, data position, optimizer hyper-parameters, Python
                           and numpy RNG states, and the run's config.
- `manifest.json`          every other file of the folder (any file: `ema.safetensors` and the like
                           are covered without being named here) with its size and sha256. Written
                           last.

A checkpoint is written to a temporary folder and renamed into place, so a crash mid-write never
leaves a folder that looks complete; the manifest catches what the rename cannot: bytes damaged,
truncated or deleted later. `verify_checkpoint` checks every file against it (size first, then
hash), and a `sharded/` folder's index and file list (a manifest anyone can recompute does not
vouch for those), and raises `CheckpointError` naming the file; a folder written before manifests existed
loads with a warning that it cannot be verified. It knows parameters by name, the optimizer and
the RNGs; what the trainer's own state means (the `state.json` entries it passes) it leaves to
the trainer.

At any world size: every rank calls `save_checkpoint` and `load_checkpoint`. Rank 0 writes the
files (replicated weights are the same on every rank), every rank its shards of sharded ones, and
a checkpoint written at one world size loads at any other, sharded or not: tensors are keyed by
parameter name whatever the layout. The RNG states written are rank 0's.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flowrl.distributed import sharded_checkpoint
from flowrl.distributed.parallel import DataParallel
from flowrl.distributed.world import World
from flowrl.models.lora import (
    check_trainable_names,
    has_lora,
    load_trainable_state_dict,
    save_lora_for_diffusers,
    trainable_state_dict,
)

_STEP_DIR = re.compile(r"^step_(\d+)$")


CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.json"
_HASH_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint folder that is damaged or incomplete; the message names the file and the fault."""


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Every `checkpoints/step_N` folder under output_dir, newest (highest step) first."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found, reverse=True)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint under output_dir that has a state.json (unverified), or None."""
    return next((p for p in checkpoint_dirs(output_dir) if (p / STATE).is_file()), None)


# --- manifest ----------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files_of(folder: Path) -> list[str]:
    """Every file under folder (recursive, POSIX relative paths), the manifest excepted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """List every file of `folder` with its size and sha256 in folder/manifest.json."""
    files = {
        name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)} for name in _files_of(folder)
    }
    (folder / MANIFEST).write_text(json.dumps({"version": 1, "files": files}, indent=1))


def _read_json(path: Path, folder: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder}: {path.name} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"checkpoint {folder}: {path.name} is not valid JSON (torn or damaged: {error})"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {folder}: {path.name} holds {type(data).__name__}, not a JSON object")
    return data


def verify_checkpoint(path: str | Path) -> bool:
    """Check every file of the checkpoint at `path` against its manifest: presence, then size, then
    sha256. Raises CheckpointError naming the first bad file; returns False (not verifiable) for a
    folder without a manifest, True when every file matches."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} is not a folder")
    if not (folder / MANIFEST).is_file():
        _read_json(folder / STATE, folder)  # still catch a missing or torn state.json
        _check_sharded(folder)
        return False
    files = _read_json(folder / MANIFEST, folder).get("files")
    if not isinstance(files, dict) or STATE not in files:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} lists no files (damaged)")
    for name, entry in files.items():
        if not (
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
        ):
            raise CheckpointError(f"checkpoint {folder}: {MANIFEST} has a damaged entry for {name}")
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {folder}: {name} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint {folder}: {name} has {size} bytes, the manifest says {entry['size']} (size mismatch: truncated?)"
            )
    for name, entry in files.items():
        if _sha256(folder / name) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint {folder}: {name} does not match its sha256 (checksum mismatch: damaged bytes)"
            )
    _read_json(folder / STATE, folder)
    _check_sharded(folder)
    return True


def _check_sharded(folder: Path) -> None:
    """A sharded/ folder holds only what flowrl writes there, its index valid (a manifest, which
    anyone can recompute, does not vouch for that): never a pickle that torch would unpickle."""
    if sharded_checkpoint.is_sharded_checkpoint(folder):
        try:
            sharded_checkpoint.check_sharded_folder(folder)
        except ValueError as error:
            raise CheckpointError(str(error)) from None


def _warn_unverified(folder: Path) -> None:
    print(
        f"warning: checkpoint {folder} has no {MANIFEST} (written by an older flowrl), so its files cannot be verified",
        file=sys.stderr,
        flush=True,
    )


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """The checkpoint `trainer.resume` names, verified.

    "never": None. "auto": the newest checkpoint under output_dir that verifies (one line on
    stderr for each newer one skipped, saying why); None if there is none. A path: that checkpoint,
    or CheckpointError naming the bad file (no fallback: the user asked for this one).
    """
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / STATE).is_file() and not (path / MANIFEST).is_file():
            raise CheckpointError(
                f"trainer.resume={resume!r} is not a checkpoint folder (no {STATE}); use 'auto', "
                f"'never' or a folder like {checkpoint_dir(output_dir, 10)}"
            )
        try:
            verified = verify_checkpoint(path)
        except CheckpointError as error:
            raise CheckpointError(
                f"trainer.resume={resume!r}: {error}; pick another checkpoint or use 'auto'"
            ) from None
        if not verified:
            _warn_unverified(path)
        return path
    for path in checkpoint_dirs(output_dir):
        try:
            verified = verify_checkpoint(path)
        except CheckpointError as error:
            print(f"warning: skipping {error}", file=sys.stderr, flush=True)
            continue
        if not verified:
            _warn_unverified(path)
        return path
    return None


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


def _optimizer_state_by_name(tensors: dict, meta: dict, names: list[str]) -> dict:
    """The saved optimizer state keyed by parameter name, in torch.distributed.checkpoint's layout:
    {"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}."""
    if meta["param_names"] != names:
        raise ValueError(
            "the checkpoint's optimizer was built over different parameters; resume with the "
            "same trainer.lora settings the checkpoint was written with"
        )
    state: dict[str, dict] = {}
    for source in (tensors, meta["scalars"]):
        for key, value in source.items():
            name, _, field = key.rpartition(".")
            state.setdefault(name, {})[field] = value
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict, meta: dict, names: list[str]) -> None:
    by_name = _optimizer_state_by_name(tensors, meta, names)
    index_of = {name: i for i, name in enumerate(names)}
    optimizer.load_state_dict(
        {
            "state": {index_of[name]: value for name, value in by_name["state"].items()},
            "param_groups": meta["param_groups"],
        }
    )


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
    parallel: DataParallel | None = None,
    averages: dict | None = None,
) -> Path:
    """Write the checkpoint of `step` (see the module docstring); returns its folder.
    ema: a flowrl.trainer.ema.ParameterEMA to save beside the weights (None: none); averages:
    other such averages by name (an algorithm's, e.g. DiffusionNFT's `old_policy`), each saved as
    `<name>.safetensors` with its meta in state.json. parallel: how the weights are kept over
    ranks (None: one process); every rank calls this."""
    world = parallel.world if parallel is not None else World.single()
    sharded = parallel is not None and parallel.is_sharded
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    world.barrier()
    transformer = adapter.transformer
    state = {"step": step, "trainer": trainer_state, "config": config}
    kept = _averages(ema, averages)
    if sharded:  # every rank writes its shards
        named = {name: p for name, p in transformer.named_parameters() if p.requires_grad}
        sharded_checkpoint.save_sharded(tmp, transformer, optimizer, named, kept)
        state["optimizer"] = {"param_names": param_names}
        state.update({key: average.meta() for key, average in kept.items()})
    elif world.is_main:
        save_file(
            {k: v.cpu().contiguous() for k, v in trainable_state_dict(transformer).items()},
            str(tmp / "trainable.safetensors"),
        )
        opt_tensors, state["optimizer"] = _optimizer_to_files(optimizer, param_names)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        if has_lora(transformer) and hasattr(adapter, "pipeline"):
            save_lora_for_diffusers(adapter, tmp / "lora")
        for key, average in kept.items():
            tensors, state[key] = average.state_dict()
            save_file(tensors, str(tmp / f"{key}.safetensors"))
    if world.is_main:
        rng_tensors, state["rng"] = _rng_to_files()
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        (tmp / STATE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)  # last: it covers every file written above
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    world.barrier()
    return final


def read_checkpoint_state(path: str | Path) -> dict:
    """The checkpoint's state.json (step, trainer state, optimizer meta, RNG, config), unverified."""
    return _read_json(Path(path) / STATE, Path(path))


def _load_tensors(folder: Path, name: str, device: str = "cpu") -> dict:
    try:
        return load_file(str(folder / name), device=device)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder}: {name} is missing") from None
    except Exception as error:  # safetensors raises its own error types for a damaged header
        raise CheckpointError(f"checkpoint {folder}: {name} cannot be read ({type(error).__name__}: {error})") from None


def load_checkpoint(
    path: str | Path,
    transformer: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    verify: bool = True,
    ema=None,
    parallel: DataParallel | None = None,
    averages: dict | None = None,
) -> dict:
    """Restore weights, optimizer and RNG (and `ema`'s and each of `averages`' values, when given
    and saved) from `path`; return {"step", "trainer", "config", "ema_restored", "restored"
    (the names of the averages restored)}. parallel: how the weights are kept over
    ranks (None: one process); every rank calls this, and the checkpoint may come from any world
    size (module docstring).

    verify=True checks the folder against its manifest first (`verify_checkpoint`); pass False
    only for a folder that `find_resume_checkpoint` has just verified.
    """
    path = Path(path)
    if verify and not verify_checkpoint(path):
        _warn_unverified(path)
    state = read_checkpoint_state(path)
    named = {name: p for name, p in transformer.named_parameters() if p.requires_grad}
    kept = _averages(ema, averages)
    if sharded_checkpoint.is_sharded_checkpoint(path):
        restored = sharded_checkpoint.load_sharded(path, transformer, optimizer, named, kept)
        for key in restored:
            kept[key].num_updates = int(state[key].get("num_updates", 0))
    else:
        restored = {key for key in kept if key in state}
        device = str(next(transformer.parameters()).device)
        weights = _load_tensors(path, "trainable.safetensors", device)
        opt_tensors = _load_tensors(path, "optimizer.safetensors", device)
        saved = {key: _load_tensors(path, f"{key}.safetensors", device) for key in restored}
        if parallel is not None and parallel.is_sharded:  # whole tensors into this rank's shards
            check_trainable_names(transformer, weights)
            sharded_checkpoint.load_full_into_sharded(
                transformer, optimizer, weights, _optimizer_state_by_name(opt_tensors, state["optimizer"], param_names)
            )
            saved = {key: sharded_checkpoint.shard_like(tensors, named) for key, tensors in saved.items()}
        else:
            load_trainable_state_dict(transformer, weights)
            _optimizer_from_files(optimizer, opt_tensors, state["optimizer"], param_names)
        for key, tensors in saved.items():
            kept[key].load_state_dict(tensors, state[key])
    _rng_from_files(_load_tensors(path, "rng.safetensors"), state["rng"])
    return {
        "step": state["step"],
        "trainer": state["trainer"],
        "config": state.get("config"),
        "ema_restored": "ema" in restored,
        "restored": restored,
    }


def _averages(ema, averages: dict | None) -> dict:
    """Every average a checkpoint keeps, by the name its files and state entry take."""
    kept = dict(averages or {})
    if ema is not None:
        kept["ema"] = ema
    return kept
