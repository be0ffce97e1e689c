"""Which rows one update trains on every rank, and how a rank keeps pace with the busiest one.

`TrainedRows` lists the rows trained in a step on all ranks, in the order one process holding them
all would have them, with the rank holding each and its row there. flowrl.trainer.update plans the
update over this list (so the plan does not depend on the world size) and each rank runs its own
rows. With sharded weights every forward and backward is a collective, so every rank must run as
many micro-batches per optimizer step: `most_micro_batches` counts the busiest rank's (each rank
counts every rank's the same way, with no collective) and `with_padding` adds weight-0 ones.

This module is numpy and torch indices only; it knows nothing of models or optimizers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flowrl.engine.output import TransitionSpec


@dataclass(frozen=True)
class TrainedRows:
    """owner (N,): the rank holding each row; index (N,): its row in that rank's tensors; weight
    (N,): its loss weight (the same as its rank's `weights` entry); group_key: per row, its
    TransitionSpec.group_key (rows sharing one may share a forward); rank: this process;
    num_ranks: the world size."""

    owner: np.ndarray
    index: np.ndarray
    weight: np.ndarray
    group_key: list
    rank: int = 0
    num_ranks: int = 1

    @classmethod
    def of_one_process(cls, specs: Sequence[TransitionSpec], weights: torch.Tensor) -> "TrainedRows":
        """Every row of one process's tensors, in order."""
        count = len(specs)
        return cls(
            np.zeros(count, dtype=np.int64),
            np.arange(count),
            weights.double().numpy(),
            [spec.group_key for spec in specs],
        )

    def held_by(self, rows: np.ndarray, rank: int) -> np.ndarray:
        """The rows of `rows` (indices into this table) that `rank` holds, in order."""
        return rows[self.owner[rows] == rank]

    def most_micro_batches(self, rows: np.ndarray, size: int) -> int:
        """The most micro-batches any rank cuts its share of `rows` into: at most `size` rows each,
        one group_key each (as flowrl.trainer.update cuts them)."""
        counts = []
        for rank in range(self.num_ranks):
            keys = Counter(self.group_key[i] for i in self.held_by(rows, rank))
            counts.append(sum(-(-count // size) for count in keys.values()))
        return max(counts)


def with_padding(micro_batches: list[torch.Tensor], padding: int):
    """(rows, is_padding) for each micro-batch, then `padding` weight-0 ones of this rank's row 0
    (any row: its loss is multiplied by 0)."""
    yield from ((rows, False) for rows in micro_batches)
    yield from ((torch.zeros(1, dtype=torch.long), True) for _ in range(padding))
