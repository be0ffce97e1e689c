"""Joining the process group of a run as one of its ranks, whoever started the process (torchrun
or a Ray worker: flowrl.distributed.launch, flowrl.distributed.ray_worker).

`join_process_group` is where every rank's device and backend are chosen: rank r takes the GPU of
its local rank (NCCL), or the CPU (gloo); collectives time out after distributed.timeout_s.
`RankFunction` is what each rank runs once it has joined.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from flowrl.config.sections import FlowRLConfig
from flowrl.distributed.world import World

RankFunction = Callable[[FlowRLConfig, World], int]


def rank_device(cfg: FlowRLConfig, local_rank: int) -> torch.device:
    """The device of the rank with this local rank: its own GPU, or the CPU."""
    device = cfg.model.resolve_device()
    if device == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(device)


def join_process_group(
    cfg: FlowRLConfig,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    device: torch.device | None = None,
    store: dist.Store | None = None,
) -> World:
    """Initialize the default process group as `rank` of `world_size` (through torchrun's env://
    variables, or `store`) on this rank's device (None: `rank_device`), and describe it."""
    device = device if device is not None else rank_device(cfg, local_rank)
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=cfg.distributed.timeout_s),
        device_id=device if device.type == "cuda" else None,  # NCCL: this rank's GPU, known up front
    )
    return World.joined(local_rank, local_world_size, device)
