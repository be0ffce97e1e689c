"""The processes of one training run: this process's rank, the world size, its device, and the few
collectives the trainer needs (gather Python objects, sum or max of numbers, barrier, broadcast).

`World.single(device)` is one process: every collective returns its input unchanged, so the
trainer runs one code path at any world size. `World.joined(...)` describes a process of an
initialized default process group (torch.distributed), whoever started it (torchrun, Ray).

This module knows torch.distributed and nothing of models, trainers or launchers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """rank / size: this process's place among all of them; local_rank / local_size: on its node.
    device: where this rank's model runs. is_distributed: a process group exists (even at world
    size 1, as under `torchrun --nproc-per-node 1`)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    is_distributed: bool = False

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "World":
        return cls(device=torch.device(device))

    @classmethod
    def joined(cls, local_rank: int, local_size: int, device: str | torch.device) -> "World":
        """This process in the initialized default process group."""
        assert dist.is_initialized(), "initialize the default process group first"
        return cls(dist.get_rank(), dist.get_world_size(), local_rank, local_size, torch.device(device), True)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, grids, checkpoints' shared files and exports."""
        return self.rank == 0

    def share(self, items: Sequence) -> tuple[int, list]:
        """(index of its first item, this rank's contiguous share of `items`): ranks in order take
        len(items) // size items each, the first len(items) % size ranks one more (a share may be
        empty)."""
        base, extra = divmod(len(items), self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, list(items[start : start + base + (self.rank < extra)])

    # --- collectives (every rank calls each one, in the same order) -------------------------------
    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.is_distributed:
            return [obj]
        gathered = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.is_distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn: Callable[[], T]) -> T:
        """fn() run on rank 0 alone (e.g. reading and verifying files), its result on every rank;
        a ValueError it raises is raised on every rank, so none waits for a result that never
        comes."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except ValueError as exc:
                error = str(exc)
        result, error = self.broadcast((result, error))
        if error is not None:
            raise ValueError(error)
        return result

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def device_idle_time(self) -> float:
        """time.perf_counter() once this rank's device has finished the work queued on it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _reduce(self, values: Sequence[float], op) -> list[float]:
        values = [float(v) for v in values]
        if not self.is_distributed or not values:
            return values
        # float64 so sums of float32 metrics do not round; NCCL reduces tensors on the GPU only.
        tensor = torch.tensor(values, dtype=torch.float64, device=self.collective_device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    @property
    def collective_device(self) -> torch.device:
        """Where tensors handed to collectives live: the GPU for NCCL, the CPU for gloo."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")
