"""Whether the update's grad passes take gradient checkpoints (`trainer.gradient_checkpointing`).

true / false: always / never. "auto": measured once per process, at its first update. A probe
scores one or two of the update's samples (those with the longest prompts, with all their CFG
rows) with grad and without checkpoints, counts the bytes autograd keeps for their backward (on
CUDA the allocator's count; elsewhere saved-tensor hooks, the weights not counted) and drops the
graph unused, so no gradient is touched. A micro-batch's activations are then about that per sample times
`trainer.micro_batch_size`, with a margin (`SAFETY_FACTOR`); checkpointing stays off when they fit
in the memory free on the device less a reserve (`RESERVE_FRACTION` of it), on every rank, and is
turned on otherwise (or when the probe itself runs out of memory).

Why it matters: a checkpoint recomputes each block's forward during the backward. A LoRA update's
forward + backward costs about two forwards (no weight gradients of the frozen base), so the
recompute adds about half of that again; it is worth its cost only where the activations do not
fit. The choice changes the update's speed and memory, never what it computes (up to rounding).

This module knows the diffusers `gradient_checkpointing` switch and the device's memory, nothing
about the loss.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flowrl.models.base import free_memory_bytes

# The micro-batch's activations are taken as this times (probe bytes per sample x samples): the
# backward holds gradients of one block's activations on top of the saved ones, and later steps'
# prompts may be longer than the first update's longest (at 512 px the 1,024 image tokens of a
# sample dominate: a full 256-token text where the probe had a short one adds about 25%).
SAFETY_FACTOR = 1.25
# The share of the free memory that is never planned for (the allocator's fragmentation, the next
# rollout's buffers, kernels' workspaces).
RESERVE_FRACTION = 0.1


@dataclass(frozen=True)
class CheckpointingChoice:
    """The decision, and for "auto" the measurements it was made from (bytes; on every rank:
    the largest need and the smallest free memory)."""

    enabled: bool
    measured: bool = False
    sample_bytes: float = 0.0
    needed_bytes: float = 0.0
    free_bytes: float = 0.0
    probe_out_of_memory: bool = False

    def describe(self) -> str:
        """One line for the console: what was chosen and why."""
        state = "on" if self.enabled else "off"
        if not self.measured:
            return f"trainer.gradient_checkpointing: {state}"
        if self.probe_out_of_memory:
            return "trainer.gradient_checkpointing=auto: on (one sample without checkpoints ran out of memory)"
        return (
            f"trainer.gradient_checkpointing=auto: {state} (a micro-batch's activations without checkpoints "
            f"need about {_size(self.needed_bytes)}, {_size(self.sample_bytes)} per sample; "
            f"{_size(self.free_bytes)} free on the device, {RESERVE_FRACTION:.0%} of it kept in reserve)"
        )

    def metrics(self) -> dict[str, float]:
        out = {"memory/gradient_checkpointing": float(self.enabled)}
        if self.measured and not self.probe_out_of_memory:
            out["memory/activations_per_sample_gb"] = self.sample_bytes / 2**30
        return out


def set_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Turn diffusers' gradient checkpointing of `model`'s blocks on or off, keeping the
    checkpoint function it was enabled with (diffusers' `disable_gradient_checkpointing` resets
    it, which would drop flowrl's checkpoint inside compiled blocks)."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing") and hasattr(module, "_gradient_checkpointing_func"):
            module.gradient_checkpointing = enabled


def saved_activation_bytes(run: Callable[[], object], model: torch.nn.Module) -> int:
    """Bytes autograd keeps for the backward of `run()`'s graph, which is then dropped without a
    backward. On CUDA: what the allocator holds more while the graph is alive (its saved tensors
    and the small outputs). Elsewhere: the tensors autograd saves (saved-tensor hooks), each
    storage once, `model`'s parameters and buffers left out. The hooks stay off on CUDA so that
    no compiled graph is ever traced with them."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return held_bytes(run, lambda: torch.cuda.memory_allocated(device))
    weights = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    saved: dict[object, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in weights:
            saved[key] = max(saved.get(key, 0), _storage_bytes(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    del result
    return sum(saved.values())


def held_bytes(run: Callable[[], object], allocated: Callable[[], int]) -> int:
    """How much `allocated()` grows while `run()`'s result is alive (0 at least); the result is then
    dropped. Python's garbage is collected first: a compile inside run() triggers many collections
    (about a thousand for a tiny Qwen-Image's first grad pass), and a reference cycle of earlier
    work that holds device tensors, freed by one of them, would be subtracted from what run()
    holds (a tiny model's probe then measured 0 bytes)."""
    gc.collect()
    before = allocated()
    result = run()
    held = allocated() - before
    del result
    return max(int(held), 0)


def needs_checkpointing(sample_bytes: float, micro_batch_size: int, free_bytes: float) -> tuple[bool, float]:
    """(checkpointing needed, bytes a micro-batch's activations are planned at)."""
    needed = sample_bytes * micro_batch_size * SAFETY_FACTOR
    return needed > free_bytes * (1.0 - RESERVE_FRACTION), needed


def choose_checkpointing(
    setting: bool | str,
    model: torch.nn.Module,
    probe: Callable[[], object],
    probe_samples: int,
    micro_batch_size: int,
    device: torch.device,
    agree_max: Callable[[list[float]], list[float]] = lambda values: values,
) -> CheckpointingChoice:
    """The update's checkpointing (module docstring) for the setting `setting`; `probe()` scores
    `probe_samples` samples with grad (called only for "auto", with checkpoints off).
    agree_max: the element-wise max over ranks (`World.max`), so every rank decides alike."""
    if setting != "auto":
        return CheckpointingChoice(enabled=bool(setting))
    set_checkpointing(model, False)
    out_of_memory = 0.0
    sample_bytes = 0.0
    try:
        sample_bytes = saved_activation_bytes(probe, model) / max(probe_samples, 1)
    except torch.OutOfMemoryError:
        out_of_memory = 1.0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    free = free_memory_bytes(device)
    # One collective for the three: the largest need, the smallest free memory, any OOM.
    sample_bytes, negative_free, out_of_memory = agree_max([sample_bytes, -float(free), out_of_memory])
    free = -negative_free
    enabled, needed = needs_checkpointing(sample_bytes, micro_batch_size, free)
    enabled = enabled or out_of_memory > 0
    set_checkpointing(model, enabled)
    return CheckpointingChoice(
        enabled=enabled,
        measured=True,
        sample_bytes=sample_bytes,
        needed_bytes=needed,
        free_bytes=free,
        probe_out_of_memory=out_of_memory > 0,
    )


def _storage_key(tensor: torch.Tensor):
    with contextlib.suppress(Exception):  # tensors without a plain storage (DTensor, subclasses)
        return (tensor.device, tensor.untyped_storage().data_ptr())
    return id(tensor)


def _storage_bytes(tensor: torch.Tensor) -> int:
    with contextlib.suppress(Exception):
        return int(tensor.untyped_storage().nbytes())
    return tensor.numel() * tensor.element_size()


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
