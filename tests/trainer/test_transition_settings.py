"""Every sample is re-scored with the settings it was drawn with: rows carrying per-row sampling
overrides (noise level, guidance, step count, step type) match their rollout log-probs, and the
first update on a recomputed denominator has ratio exactly 1."""

import pytest
import torch

from flowrl.engine.output import TransitionSpec
from flowrl.trainer.logprob import score_transitions

# Per prompt (each repeated over its group of 2). The window is fixed so that rows of different
# step counts have equally many window steps (rows of a RolloutBatch stack into one tensor); it
# starts at sigma 1, where the "sde" step uses the schedule's sigma_1, which the step count sets.
OVERRIDES = [
    None,
    {"noise_level": 1.0, "guidance_scale": 3.5},
    {"num_inference_steps": 4},
    {"sde_type": "cps", "noise_level": 0.8},
    {"sde_type": "dance", "noise_level": 0.3},
]


def _trainer(build_trainer, make_cfg, old_log_prob):
    return build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=5",
            "trainer.micro_batch_size=8",
            "rollout.sampling.guidance_scale=2.0",
            "rollout.sampling.negative_prompt=blurry",
            "rollout.sampling.sde_window=[0,2]",
            f"algorithm.old_log_prob={old_log_prob}",
            output=old_log_prob,
        )
    )


@pytest.mark.parametrize("old_log_prob", ["recompute", "rollout"])
def test_per_row_overrides_are_rescored_as_they_were_sampled(build_trainer, make_cfg, take_rollout, old_log_prob):
    trainer = _trainer(build_trainer, make_cfg, old_log_prob)
    tensors, specs = take_rollout(trainer, OVERRIDES)
    base = TransitionSpec.of(trainer.cfg.rollout.sampling)
    for row, spec in enumerate(specs):
        override = OVERRIDES[row // 2] or {}
        assert spec == TransitionSpec.of(trainer.cfg.rollout.sampling.replace(**override))
    # The control (before any update): re-scored with the config's settings, overridden rows do not match.
    with torch.no_grad():
        rows = torch.arange(2, 6)  # prompts 1 and 2 (both "sde" rows)
        step_index = torch.zeros(4, dtype=torch.long)
        mb = {name: t[rows] for name, t in tensors.items()}
        wrong = score_transitions(trainer.adapter, mb, step_index, base).log_prob
        right = score_transitions(trainer.adapter, mb, step_index, [specs[i] for i in rows.tolist()]).log_prob
    stored = tensors["all_log_probs"][rows, 0]
    assert (right - stored).abs().max() < 1e-5
    assert (wrong - stored).abs().min() > 1e-3
    metrics = trainer.algorithm.updater.prepare_and_update(
        tensors, specs, torch.linspace(-1.0, 1.0, 10), torch.ones(10), step=1
    )
    assert metrics["actor/logprob_gap_max"] < 1e-5  # CPU float32
    if old_log_prob == "recompute":  # on-policy first update: exactly 1, nothing clipped
        assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_max"] == 1.0
        assert metrics["actor/clipfrac"] == 0.0


def test_rows_of_different_step_types_are_scored_in_separate_micro_batches(build_trainer, make_cfg, take_rollout):
    trainer = _trainer(build_trainer, make_cfg, "recompute")
    tensors, specs = take_rollout(trainer, OVERRIDES)
    plan = trainer.algorithm.updater.plan(tensors, specs, step=1)
    [micro_batches] = plan.optimizer_steps  # one optimizer step, 10 rows, micro-batches of up to 8
    assert sorted(len(rows) for rows in micro_batches) == [2, 2, 6]
    for rows in micro_batches:
        assert len({specs[i].group_key for i in rows.tolist()}) == 1
    with pytest.raises(ValueError, match="group_key"):
        score_transitions(trainer.adapter, tensors, torch.zeros(10, dtype=torch.long), specs)
