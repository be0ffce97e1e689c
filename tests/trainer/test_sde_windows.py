"""rollout.sde_window_draw: one drawn SDE window per training step shared by every row (`step`),
one per row from its own seed (`row`, as verl-omni draws them), or MixGRPO's progressive
schedule (`progressive`)."""

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


def _mixgrpo_progressive(num_steps, lo, hi, size, every, shift):
    """MixGRPO's progressive schedule (fastvideo/utils/grpo_states.py, roll_back on), stepped as its
    training loop steps it: the window of each training step, then the counter's update. Where
    MixGRPO lets the last windows shrink at the end of the range before rolling back, flowrl rolls
    back as soon as a full window no longer fits: that rule here too."""
    start, in_group = lo, 0
    while True:
        yield (start, start + size)
        in_group += 1
        if in_group >= every:
            in_group = 0
            start += shift
        if start + size > hi:
            start, in_group = lo, 0


@pytest.mark.parametrize("steps, window_range, size, every, shift", [(10, None, 4, 3, 1), (25, (2, 20), 4, 5, 2)])
def test_progressive_windows_follow_mixgrpos_schedule(make_cfg, steps, window_range, size, every, shift):
    from types import SimpleNamespace

    from flowrl.trainer.flow_grpo import FlowGRPO

    overrides = [
        f"rollout.sampling.num_inference_steps={steps}",
        f"rollout.sampling.sde_window_size={size}",
        "rollout.sde_window_draw=progressive",
        f"rollout.sde_window_shift_every={every}",
        f"rollout.sde_window_shift={shift}",
    ]
    if window_range is not None:
        overrides.append(f"rollout.sampling.sde_window_range=[{window_range[0]},{window_range[1]}]")
    cfg = make_cfg(*overrides)
    algorithm = SimpleNamespace(rollout=cfg.rollout, seed=cfg.trainer.seed)
    lo, hi = window_range or (0, steps - 1)
    reference = _mixgrpo_progressive(steps, lo, hi, size, every, shift)
    windows = [FlowGRPO.sampling_overrides(algorithm, step)["sde_window"] for step in range(1, 121)]
    assert windows == [next(reference) for _ in windows]
    assert windows[0] == (lo, lo + size) and len(set(windows)) > 2  # it moves, and rolls back
    assert windows.count((lo, lo + size)) > every


def test_progressive_window_settings_are_refused_where_they_do_nothing(make_cfg):
    with pytest.raises(ValueError, match=r"rollout.sde_window_shift_every=5 .*sde_window_draw=progressive"):
        make_cfg("rollout.sde_window_shift_every=5", "rollout.sampling.sde_window_size=2")
    with pytest.raises(ValueError, match=r"rollout.sde_window_draw='progressive' .*sde_window_size"):
        make_cfg("rollout.sde_window_draw=progressive")
