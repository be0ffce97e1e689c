"""RolloutBatch: rows of prompts and, after rollout, their samples (shaped like verl's DataProto).

A batch has three parts:
- `batch`: dict of tensors whose first dim is the row (after rollout: `images` (3, H, W) uint8,
  `all_latents`, `all_log_probs`, `sigmas`, `next_sigmas`, prompt embeddings and masks; see
  flowrl.engine.output.DiffusionOutput for each one's shape);
- `non_tensor_batch`: dict of numpy object arrays with one entry per row (`raw_prompt`,
  `negative_prompt`, `agent_name`, `uid`, `data_source`, `ground_truth`, `seed`, extra fields);
- `meta_info`: free-form dict about the whole batch (timings, counters).

For a verl user: the three parts, `uid`, `raw_prompt`, `data_source`, `ground_truth`,
`all_latents` and `all_log_probs` keep verl / verl-omni's names. Two kinds of tensor are named for
what they hold instead: verl's `responses` (pixels here, not tokens) is `images`, and verl-omni's
`all_timesteps` (on the scheduler's timestep scale) is `sigmas`, the noise levels in [0, 1] at
which the window steps start, with the levels they end at stored beside them as `next_sigmas`.

Rows sharing a `uid` are one prompt's group. `stack_rows` turns per-sample tensors into `batch`.
Serialization is one safetensors file whose header metadata carries the non-tensor part as JSON
(no pickle). This module knows nothing about engines or models.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# Standard per-row fields and their defaults (uid gets a fresh uuid4 per row instead).
ROW_DEFAULTS = {
    "agent_name": "diffusion",
    "negative_prompt": None,
    "data_source": "default",
    "ground_truth": None,
    "seed": None,
}


def _object_array(values: Sequence) -> np.ndarray:
    # Filled element by element so list/tuple values stay single objects (np.array would nest).
    array = np.empty(len(values), dtype=object)
    for index, value in enumerate(values):
        array[index] = value
    return array


def _as_object_array(values) -> np.ndarray:
    if isinstance(values, np.ndarray):
        # tolist() gives Python scalars (JSON-ready) and one list per row of a 2-D array.
        return values if values.dtype == object else _object_array(values.tolist())
    return _object_array(list(values))


def _is_variable_length(name: str, names) -> bool:
    """Fields whose per-row dim 0 is a sequence length: masks and the tensors they mask."""
    return name.endswith("_mask") or f"{name}_mask" in names


def _pad_and_stack(name: str, tensors: list[torch.Tensor], names) -> torch.Tensor:
    """Stack per-row tensors; right-pad dim 0 (zeros / False) for variable-length fields."""
    first = tensors[0]
    for index, tensor in enumerate(tensors):
        if tensor.dtype != first.dtype or tensor.dim() != first.dim():
            raise ValueError(
                f"field {name!r}: row {index} is {tensor.dtype} {tuple(tensor.shape)} but "
                f"row 0 is {first.dtype} {tuple(first.shape)}; rows need one dtype and rank"
            )
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) == 1:
        return torch.stack(tensors)
    if not _is_variable_length(name, names) or first.dim() == 0 or len({s[1:] for s in shapes}) > 1:
        raise ValueError(
            f"field {name!r}: rows have different shapes {sorted(shapes)}; only masked "
            f"sequence fields (X with X_mask) may differ, and only in their first dim"
        )
    length = max(shape[0] for shape in shapes)
    out = first.new_zeros((len(tensors), length, *first.shape[1:]))  # zeros: False for bool masks
    for row, tensor in enumerate(tensors):
        out[row, : tensor.shape[0]] = tensor
    return out


def stack_rows(rows: Sequence[dict[str, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """Stack per-sample tensor dicts row-wise into `batch` tensors.

    Variable-length fields (a tensor X with a mask X_mask, e.g. prompt_embeds (L, D) and
    prompt_embeds_mask (L,)) are right-padded to the longest row with zeros / False. Fields that
    are None (or absent) in every row are omitted; None in some rows only is an error.
    """
    if not rows:
        raise ValueError("stack_rows got no rows; pass one dict of tensors per sample")
    names = list(dict.fromkeys(name for row in rows for name in row))
    stacked = {}
    for name in names:
        values = [row.get(name) for row in rows]
        missing = [index for index, value in enumerate(values) if value is None]
        if len(missing) == len(values):
            continue
        if missing:
            raise ValueError(
                f"field {name!r} is None in rows {missing[:8]} but a tensor in others; every row must have it, or none"
            )
        if not all(isinstance(value, torch.Tensor) for value in values):
            raise ValueError(f"field {name!r} holds a non-tensor value; put it in non_tensor_batch instead")
        for index, row in enumerate(rows):
            mask = row.get(f"{name}_mask")
            if mask is not None and mask.shape[0] != row[name].shape[0]:
                raise ValueError(
                    f"row {index}: {name} has length {row[name].shape[0]} but {name}_mask "
                    f"has length {mask.shape[0]}; they must match"
                )
        stacked[name] = _pad_and_stack(name, values, names)
    return stacked


@dataclass
class RolloutBatch:
    """Rows of a rollout: tensors, per-row metadata and batch-level info (see module doc)."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self):
        self.non_tensor_batch = {name: _as_object_array(values) for name, values in self.non_tensor_batch.items()}
        self._check_lengths()

    def _check_lengths(self) -> None:
        for name, tensor in self.batch.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                raise ValueError(
                    f"batch field {name!r} must be a tensor whose first dim is the row; "
                    "put scalars in meta_info and non-tensors in non_tensor_batch"
                )
        lengths = {name: len(t) for name, t in self.batch.items()}
        lengths.update({name: len(a) for name, a in self.non_tensor_batch.items()})
        if len(set(lengths.values())) > 1:
            expected = next(iter(lengths.values()))
            bad = next(name for name, n in lengths.items() if n != expected)
            raise ValueError(
                f"field {bad!r} has {lengths[bad]} rows but {next(iter(lengths))!r} has "
                f"{expected}; every tensor and non-tensor field needs one entry per row"
            )

    # ---- construction ----

    @classmethod
    def from_rows(cls, rows: Sequence[dict], meta_info: dict | None = None) -> "RolloutBatch":
        """One row per dict; keys become non-tensor fields. Standard fields get defaults
        (agent_name "diffusion", data_source "default", others None, uid a fresh uuid4); an extra
        field missing from some rows is None there."""
        if not rows:
            raise ValueError("RolloutBatch.from_rows got no rows; pass at least one dict with a raw_prompt")
        for index, row in enumerate(rows):
            if not isinstance(row.get("raw_prompt"), str):
                hint = " (rename 'prompt' to 'raw_prompt')" if "prompt" in row else ""
                raise ValueError(f"row {index}: raw_prompt={row.get('raw_prompt')!r} must be the prompt text{hint}")
        names = list(dict.fromkeys(["raw_prompt", *ROW_DEFAULTS, "uid", *(n for r in rows for n in r)]))
        columns = {}
        for name in names:
            if name == "uid":
                columns[name] = [row.get("uid") or str(uuid.uuid4()) for row in rows]
            else:
                columns[name] = [row.get(name, ROW_DEFAULTS.get(name)) for row in rows]
        return cls(non_tensor_batch={n: _object_array(v) for n, v in columns.items()}, meta_info=dict(meta_info or {}))

    @classmethod
    def concat(cls, batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Rows of all batches in order. Field names must match; padded fields are re-padded.
        meta_info: the union, the first batch winning on conflicting keys."""
        if not batches:
            raise ValueError("RolloutBatch.concat got no batches")
        first = batches[0]
        for index, other in enumerate(batches[1:], start=1):
            for kind, mine, theirs in (
                ("tensor", first.batch, other.batch),
                ("non-tensor", first.non_tensor_batch, other.non_tensor_batch),
            ):
                if set(mine) != set(theirs):
                    raise ValueError(
                        f"batch {index} has {kind} fields {sorted(theirs)} but batch 0 has "
                        f"{sorted(mine)}; concat needs the same fields"
                    )
        tensors = {}
        for name in first.batch:
            rows = [row for b in batches for row in b.batch[name].unbind(0)]
            if _is_variable_length(name, first.batch):
                # Batches may be padded to different lengths: re-pad all rows to the longest.
                tensors[name] = _pad_and_stack(name, rows, first.batch)
            else:
                tensors[name] = torch.cat([b.batch[name] for b in batches])
        non_tensors = {
            name: np.concatenate([b.non_tensor_batch[name] for b in batches]) for name in first.non_tensor_batch
        }
        meta = {}
        for b in reversed(batches):
            meta.update(b.meta_info)
        return cls(tensors, non_tensors, meta)

    # ---- shape ----

    def __len__(self) -> int:
        for values in (*self.batch.values(), *self.non_tensor_batch.values()):
            return len(values)
        return 0

    def repeat(self, n: int, interleave: bool = True) -> "RolloutBatch":
        """Each row n times: interleaved p0,p0,..,p1,p1,.. (default) or tiled p0,p1,..,p0,p1,..
        Copies keep their uid, so the repeats of a prompt form one group."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"repeat n={n!r} must be an integer >= 1")
        base = np.arange(len(self))
        order = np.repeat(base, n) if interleave else np.tile(base, n)
        return self.select(order)

    def select(self, indices) -> "RolloutBatch":
        """Rows at `indices` (ints, a slice, or a boolean mask), in that order; meta_info is copied."""
        size = len(self)
        if isinstance(indices, slice):
            indices = range(*indices.indices(size))
        index_array = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else list(indices))
        if index_array.dtype == bool:
            if index_array.shape != (size,):
                raise ValueError(f"boolean mask has shape {index_array.shape}; it needs one entry per row ({size})")
            index_array = np.flatnonzero(index_array)
        index_array = index_array.astype(np.int64).reshape(-1)
        if index_array.size and (index_array.min() < -size or index_array.max() >= size):
            raise IndexError(f"row indices {index_array.tolist()[:8]} are out of range for a batch of {size} rows")
        index_array = index_array % max(size, 1)
        torch_index = torch.from_numpy(index_array)
        tensors = {name: t.index_select(0, torch_index.to(t.device)) for name, t in self.batch.items()}
        non_tensors = {name: a[index_array] for name, a in self.non_tensor_batch.items()}
        return RolloutBatch(tensors, non_tensors, dict(self.meta_info))

    def __getitem__(self, key):
        """batch["field"] -> that tensor or array; batch[i] -> a 1-row batch; slices, index lists
        and boolean masks -> `select`."""
        if isinstance(key, str):
            if key in self.batch:
                return self.batch[key]
            if key in self.non_tensor_batch:
                return self.non_tensor_batch[key]
            raise KeyError(f"no field {key!r}; fields: {sorted([*self.batch, *self.non_tensor_batch])}")
        if isinstance(key, (int, np.integer)):
            return self.select([int(key)])
        return self.select(key)

    def split(self, size: int) -> list["RolloutBatch"]:
        """Consecutive chunks of `size` rows (the last may be shorter)."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"split size={size!r} must be an integer >= 1")
        starts = range(0, len(self), size)
        return [self.select(range(start, min(start + size, len(self)))) for start in starts]

    # ---- adding fields ----

    def add_tensors(self, tensors: dict[str, torch.Tensor]) -> "RolloutBatch":
        """Attach (or replace) tensor fields in place; each needs one entry per row. Returns self."""
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"field {name!r} is a {type(tensor).__name__}, not a tensor; use add_non_tensors")
            if tensor.dim() == 0:
                raise ValueError(f"field {name!r} is a 0-d tensor; it needs one entry per row (dim 0)")
            self._check_new_field(name, len(tensor))
            self.batch[name] = tensor
        return self

    def add_non_tensors(self, values: dict[str, Sequence]) -> "RolloutBatch":
        """Attach (or replace) per-row non-tensor fields in place (e.g. the seeds used). Returns self."""
        for name, column in values.items():
            self._check_new_field(name, len(column))
            self.non_tensor_batch[name] = _as_object_array(column)
        return self

    def row_metadata(self, row: int) -> dict:
        """What a reward sees of row `row`: its non-tensor columns, but for the sampling overrides
        and the prompt (which the reward takes on its own)."""
        return {k: v[row] for k, v in self.non_tensor_batch.items() if k not in ("sampling_overrides", "raw_prompt")}

    def _check_new_field(self, name: str, length: int) -> None:
        has_fields = bool(self.batch or self.non_tensor_batch)
        if has_fields and length != len(self):
            raise ValueError(f"field {name!r} has {length} rows but the batch has {len(self)}")

    def union(self, other: "RolloutBatch") -> "RolloutBatch":
        """Fields of both batches (same rows). A field in both must be equal. Returns a new batch."""
        if len(other) != len(self):
            raise ValueError(f"union: the other batch has {len(other)} rows but this one has {len(self)}")
        for name in set(self.batch) & set(other.batch):
            if not torch.equal(self.batch[name], other.batch[name]):
                raise ValueError(f"union: tensor field {name!r} differs between the two batches")
        for name in set(self.non_tensor_batch) & set(other.non_tensor_batch):
            if list(self.non_tensor_batch[name]) != list(other.non_tensor_batch[name]):
                raise ValueError(f"union: non-tensor field {name!r} differs between the two batches")
        non_tensors = {**self.non_tensor_batch, **other.non_tensor_batch}
        return RolloutBatch({**self.batch, **other.batch}, non_tensors, {**other.meta_info, **self.meta_info})

    def to(self, device) -> "RolloutBatch":
        """A batch with every tensor on `device` (non-tensor fields shared)."""
        return RolloutBatch(
            {n: t.to(device) for n, t in self.batch.items()}, dict(self.non_tensor_batch), dict(self.meta_info)
        )

    # ---- serialization: one safetensors file, non-tensor part as JSON in its header ----

    def save(self, path: str) -> None:
        """Write tensors (safetensors) and non-tensor fields + meta_info (JSON in the header).
        Non-tensor values must be JSON values (tuples come back as lists)."""
        from safetensors.torch import save_file

        columns = {}
        for name, array in self.non_tensor_batch.items():
            columns[name] = [
                _json_value(value, f"non_tensor_batch[{name!r}][{row}]") for row, value in enumerate(array)
            ]
        metadata = {
            "format": "flowrl.RolloutBatch/1",
            "num_rows": str(len(self)),
            "non_tensor_batch": json.dumps(columns),
            "meta_info": json.dumps(_json_value(self.meta_info, "meta_info")),
        }
        # clone: safetensors refuses tensors that share storage (views of one buffer).
        save_file({n: t.detach().cpu().contiguous().clone() for n, t in self.batch.items()}, path, metadata)

    @classmethod
    def load(cls, path: str) -> "RolloutBatch":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != "flowrl.RolloutBatch/1":
                raise ValueError(f"{path} is not a RolloutBatch file (written by RolloutBatch.save)")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        columns = json.loads(metadata["non_tensor_batch"])
        return cls(
            tensors,
            {name: _object_array(values) for name, values in columns.items()},
            json.loads(metadata["meta_info"]),
        )


def _json_value(value, where: str):
    """`value` as plain JSON data (numpy scalars/arrays converted); ValueError naming `where` else."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [_json_value(item, where) for item in value.tolist()]
    if isinstance(value, dict):
        return {str(key): _json_value(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item, where) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ValueError(
        f"{where} is a {type(value).__name__}, which RolloutBatch.save cannot write as JSON; "
        "store str/number/bool/None/list/dict values (tensors go in batch)"
    )
