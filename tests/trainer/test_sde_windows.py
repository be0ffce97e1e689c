"""rollout.sde_window_draw: one drawn SDE window per training step shared by every row (`step`),
or one per row from its own seed (`row`, as verl-omni draws them)."""

import pytest


@pytest.mark.parametrize("draw", ["step", "row"])
def test_windows_are_drawn_per_step_or_per_row(build_trainer, make_cfg, take_rollout, draw):
    trainer = build_trainer(
        make_cfg(
            "rollout.n=4",
            "trainer.prompts_per_step=2",
            "rollout.sampling.num_inference_steps=6",
            "rollout.sampling.sde_window_size=2",
            "rollout.sampling.sde_window_range=[0,5]",
            f"rollout.sde_window_draw={draw}",
        )
    )
    overrides = trainer.algorithm.sampling_overrides(step=1)
    assert (overrides is None) == (draw == "row")
    tensors, _ = take_rollout(trainer, overrides=[overrides] * 2)
    windows = {tuple(row.tolist()) for row in tensors["sigmas"]}  # each row's window, as its sigmas
    if draw == "step":
        assert len(windows) == 1
    else:  # 8 rows' own draws over 4 possible windows
        assert len(windows) > 1
