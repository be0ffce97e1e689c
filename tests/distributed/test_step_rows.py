"""StepRows.staleness: the optimizer steps between the weights that drew each row and those of
each optimizer step of the update that trains it (policy versions count optimizer steps)."""

import numpy as np

from flowrl.distributed.step_rows import StepRows


def _rows(versions) -> StepRows:
    n = len(versions)
    return StepRows(
        rewards=np.zeros(n),
        components={},
        uids=list(range(n)),
        group_keys=[()] * n,
        policy_versions=np.asarray(versions),
        owner=np.zeros(n, dtype=np.int64),
        index=np.arange(n),
        engine=[],
        rank=0,
        num_ranks=1,
    )


def test_staleness_counts_optimizer_steps_over_the_update():
    # Synchronous, two optimizer steps per update: the first trains on-policy, the second one step on.
    assert _rows([4, 4]).staleness(start_version=4, optimizer_steps=2) == {
        "rollout/staleness_mean": 0.5,
        "rollout/staleness_max": 1,
    }
    # One step ahead with two optimizer steps per update: drawn by version 2, trained from 4 and 5.
    assert _rows([2, 2, 2]).staleness(start_version=4, optimizer_steps=2) == {
        "rollout/staleness_mean": 2.5,
        "rollout/staleness_max": 3,
    }
    # No update (nothing trained): the lag at its start.
    assert _rows([1, 3]).staleness(start_version=3, optimizer_steps=0) == {
        "rollout/staleness_mean": 1.0,
        "rollout/staleness_max": 2,
    }
