"""Group advantages against hand-computed values (global and per-group std, clamping, zero-std
groups, NaN rewards)."""

import math

import numpy as np
import pytest

from flowrl.trainer.advantages import compute_group_advantages


def test_global_std_matches_hand_computation():
    rewards = [1.0, 3.0, 10.0, 14.0]
    uids = ["a", "a", "b", "b"]
    # group means 2 and 12; global population std of [1, 3, 10, 14]: mean 7, var (36+16+9+49)/4 = 27.5
    std = math.sqrt(27.5)
    out = compute_group_advantages(rewards, uids, std_mode="global", std_eps=1e-4, adv_clip_max=5.0)
    expected = np.array([-1, 1, -2, 2]) / (std + 1e-4)
    np.testing.assert_allclose(out.values, expected, rtol=1e-6)
    assert out.zero_std_ratio == 0.0 and out.num_groups == 2


def test_group_std_and_clamp():
    rewards = [0.0, 1.0, 0.0, 0.0, 0.0, 100.0]
    uids = [0, 0, 1, 1, 1, 1]
    out = compute_group_advantages(rewards, uids, std_mode="group", std_eps=1e-4, adv_clip_max=1.5)
    # group 0: mean 0.5, std 0.5 -> +-0.5 / 0.5001
    np.testing.assert_allclose(out.values[:2], [-0.5 / 0.5001, 0.5 / 0.5001], rtol=1e-6)
    # group 1: mean 25, std sqrt(3*625 + 75^2)/2 = 43.30...; the 100 row: 75/43.30 = 1.73 -> clamped to 1.5
    std1 = np.std([0, 0, 0, 100.0])
    assert out.values[5] == pytest.approx(1.5)
    np.testing.assert_allclose(out.values[2:5], -25 / (std1 + 1e-4), rtol=1e-6)
    assert np.all(np.abs(out.values) <= 1.5)


def test_zero_std_groups_get_exact_zero_and_are_counted():
    rewards = [0.1, 0.1, 0.1, 0.3, 0.7, 0.9]
    uids = ["x", "x", "x", "y", "y", "y"]
    for mode in ("global", "group"):
        out = compute_group_advantages(rewards, uids, std_mode=mode)
        assert np.all(out.values[:3] == 0.0)
        assert out.is_zero_std.tolist() == [True] * 3 + [False] * 3
        assert out.zero_std_ratio == 0.5
        assert np.all(out.values[3:] != 0.0)


def test_nan_rewards_are_excluded():
    rewards = [1.0, float("nan"), 3.0, 2.0]
    uids = ["a", "a", "a", "b"]
    out = compute_group_advantages(rewards, uids, std_mode="group")
    assert out.is_valid.tolist() == [True, False, True, True]
    assert out.values[1] == 0.0
    # group a without the NaN row: [1, 3], mean 2, std 1
    np.testing.assert_allclose(out.values[[0, 2]], [-1 / 1.0001, 1 / 1.0001], rtol=1e-6)
    assert out.values[3] == 0.0 and out.zero_std_ratio == 0.5  # group b has one row: no spread


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="one uid per row"):
        compute_group_advantages([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="std_mode"):
        compute_group_advantages([1.0, 2.0], ["a", "a"], std_mode="batch")


def test_shuffled_advantage_control_permutes_the_trained_rows_advantages(build_trainer, make_cfg, monkeypatch):
    """algorithm.shuffle_advantages (the control run): the update gets the same advantages as the
    plain run's, on other rows, and the same permutation on a rerun of the step."""
    import numpy as np

    seen = {}

    def run(shuffle: bool, output: str):
        cfg = make_cfg(
            "rollout.n=4", "trainer.prompts_per_step=2", f"algorithm.shuffle_advantages={shuffle}", output=output
        )
        trainer = build_trainer(cfg)
        original = trainer.algorithm.updater.prepare

        def capture(tensors, specs, advantages, *args, **kwargs):
            seen[output] = advantages.clone()
            return original(tensors, specs, advantages, *args, **kwargs)

        monkeypatch.setattr(trainer.algorithm.updater, "prepare", capture)
        trainer.train_step()
        return seen[output].numpy()

    plain, shuffled, again = run(False, "plain"), run(True, "shuffled"), run(True, "again")
    assert np.array_equal(np.sort(plain), np.sort(shuffled))
    assert not np.array_equal(plain, shuffled)
    assert np.array_equal(shuffled, again)


def _flow_factory_gdpo(rewards: dict, weights: dict, group_of: np.ndarray) -> np.ndarray:
    """Flow-Factory's AdvantageProcessor.compute_gdpo, restated: per reward and group
    (r - mean) / max(std, 1e-6) times its weight, summed, then (x - mean) / std over the batch."""
    parts = []
    for key, scores in rewards.items():
        adv = np.zeros_like(scores)
        for group in np.unique(group_of):
            mask = group_of == group
            adv[mask] = (scores[mask] - scores[mask].mean()) / max(scores[mask].std(), 1e-6)
        parts.append(adv * weights[key])
    combined = np.sum(parts, axis=0)
    return (combined - combined.mean()) / combined.std()


def test_gdpo_is_flow_factorys_and_differs_from_the_weighted_sum():
    from flowrl.trainer.advantages import compute_gdpo_advantages

    rng = np.random.default_rng(0)
    group_of = np.repeat(np.arange(4), 6)
    uids = [f"p{g}" for g in group_of]
    # Two rewards of very different spreads: the weighted sum is dominated by the wide one.
    rewards = {"wide": rng.normal(0, 10.0, 24), "narrow": rng.normal(0, 0.01, 24)}
    weights = {"wide": 1.0, "narrow": 2.0}
    expected = _flow_factory_gdpo(rewards, weights, group_of)
    adv = compute_gdpo_advantages(rewards, weights, uids, "group", std_eps=1e-12, adv_clip_max=100.0)
    np.testing.assert_allclose(adv.values, expected, atol=1e-6, rtol=0)
    assert adv.is_valid.all() and not adv.is_zero_std.any()
    summed = compute_group_advantages(rewards["wide"] + 2.0 * rewards["narrow"], uids, "group", 1e-12, 100.0)
    assert np.abs(summed.values - adv.values).max() > 0.1  # the narrow reward now counts


def test_gdpo_rows_without_signal_get_zero():
    from flowrl.trainer.advantages import compute_gdpo_advantages

    uids = ["a"] * 3 + ["b"] * 3
    rewards = {"x": np.array([1.0, 1.0, 1.0, 0.0, 1.0, np.nan]), "y": np.array([2.0, 2.0, 2.0, 3.0, 1.0, 2.0])}
    adv = compute_gdpo_advantages(rewards, {"x": 1.0, "y": 1.0}, uids)
    assert adv.is_zero_std.tolist() == [True] * 3 + [False] * 3  # group a: no spread in either reward
    assert adv.values[:3].tolist() == [0.0] * 3 and adv.values[5] == 0.0  # row 5: x failed (NaN)
    assert not adv.is_valid[5] and adv.zero_std_ratio == 0.5
    assert adv.values[3] != 0.0 and adv.values[4] != 0.0
