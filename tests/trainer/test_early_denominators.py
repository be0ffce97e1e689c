"""The old-log-prob recompute scored while the rewards are computed
(flowrl.trainer.early_denominators): the update it feeds equals the update that recomputes, when
the plan is the one scored early, when rows were dropped from it, and when scoring stopped early."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flowrl.distributed.trained_rows import TrainedRows

RECOMPUTE = (
    "algorithm.old_log_prob=recompute",
    "rollout.n=2",
    "trainer.prompts_per_step=3",
    "trainer.micro_batch_size=2",
    "trainer.updates_per_step=2",
)


def _two_updates(trainer, tensors, specs, trained, early_keep_going=None) -> SimpleNamespace:
    """Update step 1 as usual (it settles gradient checkpointing), then step 2 over `trained`,
    with the recompute scored early first when early_keep_going is given; counts the recompute
    forwards the update itself ran."""
    updater = trainer.algorithm.updater
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    updater.prepare_and_update(tensors, specs, advantages, torch.ones(6), step=1)
    all_rows = TrainedRows.of_one_process(specs, torch.ones(6))
    if early_keep_going is not None:
        updater.score_early(tensors, specs, 2, all_rows, early_keep_going)
    run = SimpleNamespace(recomputed_in_update=0)
    original = updater._score_denominator

    def counted(*args):
        run.recomputed_in_update += 1
        return original(*args)

    updater._score_denominator = counted
    run.metrics = updater.prepare_and_update(tensors, specs, advantages, torch.ones(6), step=2, trained=trained)
    run.records = [(r.rows.tolist(), r.loss, r.clipfrac, r.grad_norm) for r in updater.records]
    run.weights = [p.detach().clone() for p in updater.params]
    return run


def _some_rows(specs, rows) -> TrainedRows:
    """The rows `rows` of one process, as the trainer passes them when the others are not trained."""
    rows = np.asarray(rows)
    return TrainedRows(
        np.zeros(len(rows), dtype=np.int64), rows, np.ones(len(rows)), [specs[i].group_key for i in rows]
    )


@pytest.mark.parametrize(
    "trained_rows, stop_after, early_share",
    [(None, None, 1.0), ([0, 1, 3, 4, 5], None, None), (None, 1, None)],
    ids=["same-plan", "rows-dropped", "stopped-early"],
)
def test_the_update_from_early_denominators_equals_the_recomputing_one(
    build_trainer, make_cfg, take_rollout, trained_rows, stop_after, early_share
):
    trainers = [build_trainer(make_cfg(*RECOMPUTE, output=f"run{i}")) for i in range(2)]
    tensors, specs = take_rollout(trainers[0])
    trained = None if trained_rows is None else _some_rows(specs, trained_rows)
    calls = []

    def keep_going():
        calls.append(1)
        return stop_after is None or len(calls) <= stop_after

    early = _two_updates(trainers[0], tensors, specs, trained, keep_going)
    plain = _two_updates(trainers[1], tensors, specs, trained)
    # The same forwards give the same denominators: the same update, to the bit.
    assert early.records == plain.records
    assert all(torch.equal(a, b) for a, b in zip(early.weights, plain.weights))
    assert early.metrics["actor/policy_loss"] == plain.metrics["actor/policy_loss"]
    assert plain.metrics["actor/old_log_prob_early_share"] == 0.0 and plain.recomputed_in_update > 0
    share = early.metrics["actor/old_log_prob_early_share"]
    if early_share is not None:  # every recompute forward came from the early scoring
        assert share == early_share and early.recomputed_in_update == 0
    elif trained_rows is None:  # stopped after one forward: the update scored the rest
        assert 0 < share < 1 and early.recomputed_in_update == plain.recomputed_in_update - 1
    else:  # another plan: nothing matched (rows are drawn in another order), all recomputed
        assert early.recomputed_in_update == plain.recomputed_in_update


def test_the_trainer_scores_the_recompute_while_rewards_are_pending(build_trainer, make_cfg, monkeypatch):
    """From the second step on (the first settles checkpointing), with the rewards still being
    scored, the recompute runs before the reward wait ends and the update takes it whole; its time
    counts as the old log-prob's."""
    trainer = build_trainer(make_cfg(*RECOMPUTE))
    monkeypatch.setattr(trainer.scorer, "is_done", lambda: False)  # rewards that take their time
    first, second = trainer.train_step(), trainer.train_step()
    assert "timing/old_log_prob_early_s" not in first and first["actor/old_log_prob_early_share"] == 0.0
    assert second["actor/old_log_prob_early_share"] == 1.0
    assert 0 < second["timing/old_log_prob_early_s"] <= second["timing/old_log_prob_s"]


def test_rollout_denominators_score_nothing_early(build_trainer, make_cfg):
    trainer = build_trainer(make_cfg(*RECOMPUTE[1:], "algorithm.old_log_prob=rollout"))
    trainer.train_step()
    second = trainer.train_step()
    assert not trainer.algorithm.updater.scores_early
    assert "timing/old_log_prob_early_s" not in second and "actor/old_log_prob_early_share" not in second


@pytest.mark.gpu
def test_early_denominators_on_cuda_in_bf16(build_trainer, make_cfg, take_rollout):
    """The CUDA path: the early forwards are queued two at a time behind events, and the update
    that takes them all equals the recomputing one."""
    on_cuda = ("model.device=cuda", "model.dtype=bfloat16", "trainer.mixed_precision=bf16")
    trainers = [build_trainer(make_cfg(*RECOMPUTE, *on_cuda, output=f"run{i}")) for i in range(2)]
    tensors, specs = take_rollout(trainers[0])
    early = _two_updates(trainers[0], tensors, specs, None, lambda: True)
    plain = _two_updates(trainers[1], tensors, specs, None)
    assert early.metrics["actor/old_log_prob_early_share"] == 1.0 and early.recomputed_in_update == 0
    assert early.records == plain.records
    assert all(torch.equal(a, b) for a, b in zip(early.weights, plain.weights))
