"""Checkpoint tensors of sharded (FSDP2) training through torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the trained weights, the optimizer state and the EMA averages
into one folder (`sharded/` of a checkpoint; a shared filesystem when ranks span nodes), and any
world size reads them back: DCP reshards on load, into sharded parameters or plain ones (one
process, no process group). `load_full_into_sharded` goes the other way round: a checkpoint of whole
tensors (written by one process) into sharded parameters, `shard_like` splits other whole tensors
kept per parameter (EMA averages) the same way. `read_full_tensors` gathers the shards into whole
tensors without any process group (eval, generate and serve of a sharded run).

Nothing in `sharded/` is read by unpickling, so a checkpoint cannot run code when it loads. DCP's
own file format pickles its index (`.metadata`) and non-tensor values; flowrl gives DCP a storage
of its own instead (flowrl.distributed.dcp_storage): each rank's chunks in
`rank<N>.safetensors`, the index (every tensor's dtype, size and chunks, and where each chunk lies)
in `index.json`, and the optimizer's non-tensor state (its parameter groups' hyper-parameters) in
`optimizer.json`. `check_sharded_folder` validates the index before anything reads a tensor and
refuses any other file, a pickled `.metadata` above all.

Tensors are keyed by parameter name, the optimizer state by parameter name too (DCP's own layout
from torch.distributed.checkpoint.state_dict), so a checkpoint does not depend on how the weights
were split. This module knows parameters, an optimizer and the averages of a
flowrl.trainer.ema.ParameterEMA (the EMA, DiffusionNFT's old policy) by name; what else a checkpoint holds it leaves to its caller.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

SHARDED_DIR = "sharded"
INDEX = "index.json"
OPTIMIZER = "optimizer.json"
FORMAT = "flowrl.sharded/1"  # the index's tag, which flowrl.distributed.dcp_storage writes
_RANK_FILE = re.compile(r"^rank(\d+)\.safetensors$")


def is_sharded_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / SHARDED_DIR).is_dir()


# --- the index ------------------------------------------------------------------------------------


def _is_count_list(value, length: int | None = None) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        and (length is None or len(value) == length)
    )


def check_sharded_folder(folder: str | Path) -> dict:
    """The validated tensor index of folder/sharded ({name: {dtype, size, chunks}}); ValueError
    naming the file and the fault for anything else: a missing or malformed index.json, a chunk
    outside its tensor or in a file flowrl does not write, and any file the index does not account
    for (a pickled `.metadata` above all: module docstring). Nothing is unpickled."""
    path = Path(folder) / SHARDED_DIR
    where = f"checkpoint {folder}: {SHARDED_DIR}/"
    try:
        index = json.loads((path / INDEX).read_text())
    except FileNotFoundError:
        old = " and holds torch's pickled DCP metadata (.metadata)" if (path / ".metadata").exists() else ""
        raise ValueError(
            f"{where}{INDEX} is missing{old}; it was not written by this flowrl, which never reads a pickled "
            "index (loading one can run code): use a checkpoint written by this version"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}{INDEX} is not valid JSON ({error})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("tensors"), dict):
        raise ValueError(f"{where}{INDEX} is not a flowrl index (format {FORMAT!r} with a 'tensors' object)")
    files = {INDEX, OPTIMIZER}
    for name, entry in index["tensors"].items():
        fault = None
        if not isinstance(entry, dict) or not isinstance(entry.get("chunks"), list):
            fault = "is not an object with chunks"
        elif not isinstance(getattr(torch, str(entry.get("dtype")), None), torch.dtype):
            fault = f"has dtype {entry.get('dtype')!r}, not a torch dtype"
        elif not _is_count_list(entry.get("size")):
            fault = f"has size {entry.get('size')!r}, not a list of counts"
        for chunk in [] if fault else entry["chunks"]:
            ndim = len(entry["size"])
            ok = isinstance(chunk, dict) and _is_count_list(chunk.get("offsets"), ndim)
            ok = ok and _is_count_list(chunk.get("sizes"), ndim) and isinstance(chunk.get("key"), str)
            ok = ok and all(o + n <= s for o, n, s in zip(chunk["offsets"], chunk["sizes"], entry["size"]))
            if not ok or not _RANK_FILE.match(str(chunk.get("file"))):
                fault = f"has a damaged chunk {chunk!r}"
                break
            files.add(chunk["file"])
        if fault:
            raise ValueError(f"{where}{INDEX}: tensor {name!r} {fault}")
    unknown = sorted(p.name for p in path.iterdir() if p.name not in files)
    if unknown:
        raise ValueError(
            f"{where} holds {', '.join(unknown)}, which flowrl does not write (a pickled .metadata would run code "
            "if torch read it; flowrl never reads one): delete it, or use another checkpoint"
        )
    return index["tensors"]


# --- saving and loading ---------------------------------------------------------------------------


def _state(
    module: torch.nn.Module, optimizer, params: dict[str, torch.Tensor], averages: dict
) -> tuple[dict, dict, dict]:
    """(tensors, optimizer state dict, non-tensor optimizer state): what DCP saves and loads in
    place, flat: the parameters' own storage (so a load writes into the model), the optimizer's
    tensors by name (`optimizer.state.<param>.<key>`, the same tensor objects as in the optimizer
    state dict), each average's tensors (`<its name>.<param>`: `ema.`, `old_policy.`); the
    optimizer's parameter groups and non-tensor values go to JSON."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    tensors = {f"model.{name}": param.detach() for name, param in params.items()}
    optimizer_state = get_optimizer_state_dict(module, optimizer)
    values = {}
    for name, per_param in optimizer_state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.state.{name}.{key}"] = value
            else:
                values.setdefault(name, {})[key] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optimizer_state["param_groups"]
    ]
    for key, kept in averages.items():
        tensors.update({f"{key}.{name}": average for name, average in kept.averages.items()})
    return tensors, optimizer_state, {"param_groups": groups, "values": values}


def save_sharded(
    folder: Path, module: torch.nn.Module, optimizer, params: dict[str, torch.Tensor], averages: dict | None = None
) -> None:
    """Every rank writes its shards under folder/sharded (a collective); averages: {name:
    flowrl.trainer.ema.ParameterEMA} kept beside the weights."""
    import torch.distributed.checkpoint as dcp

    from flowrl.distributed.dcp_storage import SafetensorsWriter

    path = Path(folder) / SHARDED_DIR
    tensors, _, rest = _state(module, optimizer, params, averages or {})
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / OPTIMIZER).write_text(json.dumps(rest, indent=1))
    with warnings.catch_warnings():  # DCP warns that one process saves without a process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=SafetensorsWriter(path, INDEX, FORMAT), no_dist=not dist.is_initialized())


def load_sharded(
    folder: Path, module: torch.nn.Module, optimizer, params: dict[str, torch.Tensor], averages: dict | None = None
) -> set[str]:
    """Load folder/sharded into the parameters, the optimizer and each of `averages` ({name:
    ParameterEMA}) that was saved, whatever the world size it was written at; returns the names
    of the averages restored.
    ValueError when the folder is not one this module wrote (`check_sharded_folder`) or the saved
    tensors are not these parameters'."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from flowrl.distributed.dcp_storage import SafetensorsReader

    path = Path(folder) / SHARDED_DIR
    index = check_sharded_folder(folder)
    saved = set(index)
    expected = {f"model.{name}" for name in params}
    weights = {key for key in saved if key.startswith("model.")}
    if weights != expected:
        missing, extra = sorted(expected - weights)[:5], sorted(weights - expected)[:5]
        raise ValueError(
            f"checkpoint {folder}: its sharded weights do not match the trainable parameters (missing {missing}, "
            f"unexpected {extra}); resume with the trainer.lora settings the checkpoint was written with"
        )
    restored = {key for key in averages or {} if any(k.startswith(f"{key}.") for k in saved)}
    tensors, optimizer_state, _ = _state(module, optimizer, params, {key: averages[key] for key in restored})
    try:
        rest = json.loads((path / OPTIMIZER).read_text())
        groups, values = rest["param_groups"], rest["values"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"checkpoint {folder}: {SHARDED_DIR}/{OPTIMIZER} is missing or damaged ({error})") from None
    with warnings.catch_warnings():  # DCP warns that one process loads without a process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=SafetensorsReader(path, index), no_dist=not dist.is_initialized())
    for name, per_param in values.items():
        optimizer_state["state"].setdefault(name, {}).update(per_param)
    optimizer_state["param_groups"] = groups
    set_optimizer_state_dict(module, optimizer, optimizer_state)
    return restored


def read_full_tensors(folder: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """{name: whole tensor} of every saved tensor named `prefix.<name>` ("model": the trained
    weights, "ema": their averages), gathered from all ranks' chunks in this process, with no
    process group."""
    path = Path(folder) / SHARDED_DIR
    out, handles = {}, {}
    try:
        for fqn, entry in check_sharded_folder(folder).items():
            if not fqn.startswith(prefix + "."):
                continue
            whole = torch.empty(entry["size"], dtype=getattr(torch, entry["dtype"]))
            for chunk in entry["chunks"]:
                if chunk["file"] not in handles:
                    handles[chunk["file"]] = safe_open(str(path / chunk["file"]), framework="pt")
                part = handles[chunk["file"]].get_tensor(chunk["key"])
                target = whole
                for dim, (offset, size) in enumerate(zip(chunk["offsets"], chunk["sizes"])):
                    target = target.narrow(dim, offset, size)
                target.copy_(part)
            out[fqn.removeprefix(prefix + ".")] = whole
    finally:
        handles.clear()
    return out


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
