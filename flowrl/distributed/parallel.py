"""How the trained weights are kept across ranks and how their gradients are combined.

Chosen once, when the trainer is built (`DataParallel.wrap`):
- "single": one process, nothing to combine.
- "replicate" (LoRA): every rank holds every weight; after the micro-batches of an optimizer step
  the gradients of the trainable tensors (only those) are summed over the ranks in a few flat
  buckets, as DDP does, without DDP's wrapper: the engine and the trainer call the transformer
  itself, and ranks may run different numbers of backward passes in one optimizer step.
- "shard" (full fine-tuning): FSDP2, `fully_shard` on every transformer block and on the root;
  each rank keeps 1/world of the weights, gradients and optimizer state. A sharded forward or
  backward all-gathers a block's weights and reduce-scatters its gradients, so every rank must run
  as many of them: the update pads ranks with fewer micro-batches with weight-0 ones
  (`pads_micro_batches`). Rollouts instead gather the whole weights once (`rollout_weights`) and
  then run with no collective at all, so each rank's engine batches its samples as it likes.

Gradients are SUMMED over ranks, never averaged: each rank divides its loss by the optimizer step's
global count of (row, step) pairs (flowrl.trainer.update), so the sum is the one-process gradient
whichever rank holds which rows.

This module knows torch.distributed and FSDP2, nothing of the trainer's algorithm.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
import torch.distributed as dist

from flowrl.distributed.world import World

ParallelMode = Literal["single", "replicate", "shard"]
# Gradients are all-reduced in flat buckets of about this size (DDP's default bucket size).
BUCKET_BYTES = 25 << 20


def _fsdp_modules(module: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def transformer_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a diffusers transformer: the members of its ModuleList children
    (`transformer_blocks`, and FLUX-style `single_transformer_blocks`)."""
    return [block for child in transformer.children() if isinstance(child, torch.nn.ModuleList) for block in child]


class DataParallel:
    """The strategy of the module docstring, for one transformer."""

    def __init__(self, world: World, mode: ParallelMode, module: torch.nn.Module | None = None):
        assert (mode == "shard") == (module is not None)
        self.world = world
        self.mode = mode
        self.module = module

    @classmethod
    def wrap(cls, transformer: torch.nn.Module, world: World, full_fine_tuning: bool) -> "DataParallel":
        """Pick the strategy for this world and, for "shard", shard `transformer` in place (call it
        after the trainable parameters are chosen and before anything holds them: sharding
        replaces every parameter object)."""
        if not world.is_distributed:
            return cls(world, "single")
        if not full_fine_tuning:
            return cls(world, "replicate")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        blocks = transformer_blocks(transformer)
        if not blocks:
            raise ValueError(
                f"{type(transformer).__name__} has no block list to shard; full fine-tuning over several "
                "processes needs a transformer with ModuleList blocks (set trainer.lora.enabled=true)"
            )
        mesh = init_device_mesh(world.device.type, (world.size,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(transformer, mesh=mesh, reshard_after_forward=True)
        for module in _fsdp_modules(transformer):
            module.set_gradient_divide_factor(1.0)  # sum, not mean (module docstring)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        return cls(world, "shard", transformer)

    @property
    def is_sharded(self) -> bool:
        return self.mode == "shard"

    @property
    def pads_micro_batches(self) -> bool:
        """Whether every rank must run as many forwards and backwards in an update."""
        return self.mode == "shard"

    # --- gradients ---------------------------------------------------------------------------------
    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over the ranks (after an optimizer step's backwards).
        A parameter without a gradient on this rank (it held no rows) contributes zeros."""
        if self.mode != "replicate":
            return  # one process, or FSDP2 reduced them in the backward already
        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_ over the whole (summed) gradient, sharded or not; returns
        the norm before clipping, the same on every rank."""
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(total.full_tensor() if hasattr(total, "full_tensor") else total)  # a DTensor when sharded

    # --- weights -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rollout_weights(self):
        """Inside the block the sharded transformer holds its whole weights and its forwards run
        no collective (module docstring); nothing changes for the other modes."""
        if self.mode != "shard":
            yield
            return
        modules = _fsdp_modules(self.module)
        self.module.set_reshard_after_forward(False)
        for module in modules:
            module.unshard()
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
            self.module.set_reshard_after_forward(True)

    def gathered_state_dict(self, transformer: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole weights of a sharded transformer, on rank 0's CPU (the other ranks get an empty
        dict); every rank must call it, as the shards are all-gathered. None when not sharded: the
        module holds its whole weights itself."""
        if self.mode != "shard":
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {name: _owning(tensor) for name, tensor in state.items()}


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied when it is a view into a larger storage: a parameter whose first dimension
    is smaller than the world (Wan's (1, 2, dim) `scale_shift_table` over two ranks) comes back
    from the gather as a view of its padded shards, which safetensors refuses to save."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, cut at about BUCKET_BYTES."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        last = buckets[-1][-1] if buckets else None
        nbytes = tensor.numel() * tensor.element_size()
        if last is None or (last.dtype, last.device) != (tensor.dtype, tensor.device) or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets
