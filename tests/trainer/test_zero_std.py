"""Zero-std groups: counted, advantage 0, kept in the loss or dropped per algorithm.zero_std_policy."""

import numpy as np
import pytest

from flowrl.rewards.base import Reward


class FirstPromptConstant(Reward):
    """Reward 1.0 for every sample of the step's first prompt (a zero-std group), noise otherwise."""

    name = "first_prompt_constant"

    def score_batch(self, images, prompts, metadata):
        # Decided per row (uids are "step{k}-prompt{i}"), not per scored chunk: async scoring may
        # hand any subset of the rows to one call.
        rng = np.random.default_rng()
        return np.array([1.0 if m["uid"].endswith("prompt0") else rng.normal() for m in metadata])


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_zero_std_policy(build_trainer, make_cfg, policy):
    cfg = make_cfg("rollout.n=2", "trainer.prompts_per_step=2", f"algorithm.zero_std_policy={policy}")
    trainer = build_trainer(cfg, reward=FirstPromptConstant())
    metrics = trainer.train_step()
    assert metrics["adv/zero_std_ratio"] == 0.5
    assert metrics["adv/num_rows_trained"] == (4 if policy == "keep" else 2)
    assert metrics["actor/num_optimizer_steps"] == 1 and trainer.policy_version == 1


class Constant(Reward):
    """The same score for every image: every group has zero spread (as OCR on a model that draws no text)."""

    name = "constant"

    def score_batch(self, images, prompts, metadata):
        return np.zeros(len(images))


def test_mostly_zero_spread_groups_warn_once_and_in_the_summary(build_trainer, make_cfg, capsys):
    cfg = make_cfg("rollout.n=2", "trainer.prompts_per_step=2", "trainer.total_steps=3")
    build_trainer(cfg, reward=Constant()).fit()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(lines) == 2, lines
    first, summary = lines
    assert first.startswith("warning: step 1: 100% of the prompt groups") and "adv/zero_std_ratio" in first
    assert "saturated or constant" in first and "rollout.n=2" in first and "reward 'constant'" in first
    assert summary.startswith("warning: 3 of 3 steps had more than 50%") and "adv/zero_std_ratio" in summary


def test_zero_spread_warning_threshold():
    from flowrl.run.health import ZeroSpreadWatch

    written = []
    watch = ZeroSpreadWatch("ocr", 16, write=written.append)
    watch.observe(1, {"adv/zero_std_ratio": 0.5})  # half the groups: not "most"
    assert not written and watch.summary() is None
    watch.observe(2, {"adv/zero_std_ratio": 0.75})
    watch.observe(3, {"adv/zero_std_ratio": 1.0})
    assert len(written) == 1 and "step 2: 75%" in written[0] and "OCR on a model that draws no text" in written[0]
    assert watch.summary().startswith("warning: 2 of 3 steps")


class NullForEveryImage(Reward):
    """A reward that answers null for every image (an HTTP scorer returning null): NaN everywhere."""

    name = "null_scorer"

    def score_batch(self, images, prompts, metadata):
        return np.full(len(images), np.nan)


def test_a_reward_nan_for_every_image_warns_and_stops_past_the_bound(build_trainer, make_cfg, capsys):
    from flowrl.run.health import TrainingStalled

    cfg = make_cfg("rollout.n=2", "trainer.prompts_per_step=2", "trainer.total_steps=5")
    cfg.trainer.max_steps_without_trained_rows = 2
    trainer = build_trainer(cfg, reward=NullForEveryImage())
    with pytest.raises(TrainingStalled) as stalled:
        trainer.fit()
    assert trainer.step == 2  # stopped at the bound, not at total_steps
    message = str(stalled.value)
    assert message.startswith("stopped after step 2: 2 steps in a row trained no row") and "\n" not in message
    assert "reward/nan_ratio 1.0" in message and "'null_scorer'" in message
    assert "trainer.max_steps_without_trained_rows=2" in message
    warnings = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: step 1 trained no row")
    ]
    assert len(warnings) == 1 and "NaN" in warnings[0]


def test_zero_spread_steps_stop_at_the_bound_and_zero_never_stops():
    from flowrl.run.health import NoTrainingWatch, TrainingStalled

    flat = {"adv/num_rows_trained": 0, "reward/nan_ratio": 0.0, "adv/zero_std_ratio": 1.0}
    written = []
    watch = NoTrainingWatch("constant", 3, write=written.append)
    watch.observe(1, flat)
    watch.observe(2, flat)
    watch.observe(3, {**flat, "adv/num_rows_trained": 4})  # a trained step ends the streak
    watch.observe(4, flat)
    watch.observe(5, flat)
    with pytest.raises(TrainingStalled, match=r"step 6: 3 steps in a row .* algorithm.zero_std_policy=drop"):
        watch.observe(6, flat)
    assert not written  # the zero-spread case is ZeroSpreadWatch's warning
    never = NoTrainingWatch("constant", 0, write=written.append)
    for step in range(1, 50):
        never.observe(step, {**flat, "reward/nan_ratio": 1.0})
    assert len(written) == 1 and "the run goes on" in written[0]


def test_cli_stalled_run_exits_2_with_one_line(tiny_sd3_path, tmp_path, capsys):
    from flowrl.cli import main
    from flowrl.rewards import register_reward, unregister_reward

    register_reward("null_scorer", NullForEveryImage)
    try:
        args = [
            "train",
            f"model.path={tiny_sd3_path}",
            f"trainer.output_dir={tmp_path / 'out'}",
            "reward.name=null_scorer",
        ]
        args += ["rollout.n=2", "trainer.prompts_per_step=2", "trainer.max_steps_without_trained_rows=1"]
        args += ["trainer.val_every=0", "logging.progress_bar=false", "logging.tensorboard=false"]
        assert main(args) == 2
    finally:
        unregister_reward("null_scorer")
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("flowrl train: error: stopped after step 1")
