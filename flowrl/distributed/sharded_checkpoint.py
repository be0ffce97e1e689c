"""Checkpoint tensors of sharded (FSDP2) training through torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the trained weights, the optimizer state and the EMA averages
into one folder (`sharded/` of a checkpoint; a shared filesystem when ranks span nodes), and any
world size reads them back: DCP reshards on load, into sharded parameters or plain ones (one
process, no process group). `load_full_into_sharded` goes the other way round: a checkpoint of whole
tensors (written by one process) into sharded parameters, `shard_like` splits other whole tensors
kept per parameter (EMA averages) the same way.

Tensors are keyed by parameter name, the optimizer state by parameter name too (DCP's own layout
from torch.distributed.checkpoint.state_dict), so a checkpoint does not depend on how the weights
were split. This module knows parameters, an optimizer and the averages of a
flowrl.trainer.ema.ParameterEMA by name; what else a checkpoint holds it leaves to its caller.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist

SHARDED_DIR = "sharded"


def is_sharded_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / SHARDED_DIR).is_dir()


def _state(module: torch.nn.Module, optimizer, params: dict[str, torch.Tensor], ema) -> dict:
    """What DCP saves and loads in place: the parameters' own storage (so a load writes into the
    model), the optimizer state by name, the EMA averages."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {
        "model": {name: param.detach() for name, param in params.items()},
        "optimizer": get_optimizer_state_dict(module, optimizer),
    }
    if ema is not None:
        state["ema"] = dict(ema.averages)
    return state


def save_sharded(folder: Path, module: torch.nn.Module, optimizer, params: dict[str, torch.Tensor], ema=None) -> None:
    """Every rank writes its shards under folder/sharded (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(module, optimizer, params, ema), checkpoint_id=str(Path(folder) / SHARDED_DIR))


def load_sharded(folder: Path, module: torch.nn.Module, optimizer, params: dict[str, torch.Tensor], ema=None) -> bool:
    """Load folder/sharded into the parameters, the optimizer and `ema` (when given and saved),
    whatever the world size it was written at; returns whether EMA averages were restored.
    ValueError when the saved tensors are not these parameters'."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    path = Path(folder) / SHARDED_DIR
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    expected = {f"model.{name}" for name in params}
    weights = {key for key in saved if key.startswith("model.")}
    if weights != expected:
        missing, extra = sorted(expected - weights)[:5], sorted(weights - expected)[:5]
        raise ValueError(
            f"checkpoint {folder}: its sharded weights do not match the trainable parameters (missing {missing}, "
            f"unexpected {extra}); resume with the trainer.lora settings the checkpoint was written with"
        )
    ema_saved = any(key.startswith("ema.") for key in saved)
    state = _state(module, optimizer, params, ema if ema_saved else None)
    with warnings.catch_warnings():  # DCP warns that one process loads without a process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_optimizer_state_dict(module, optimizer, state["optimizer"])
    return ema is not None and ema_saved


def load_full_into_sharded(
    module: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor], optimizer_state: dict
) -> None:
    """Whole tensors (on every rank) into the sharded parameters and their optimizer state.
    optimizer_state: {"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # strict=False: the model's state dict also holds its buffers, which a checkpoint's weights do not.
    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    set_optimizer_state_dict(module, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))


def shard_like(tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors split as the parameters of the same names are (sharded ones become DTensors)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for name, tensor in tensors.items():
        param = params.get(name)
        if isinstance(param, DTensor):
            tensor = distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements)
        out[name] = tensor
    return out
