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
