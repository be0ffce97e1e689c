"""Zero-std groups: counted, advantage 0, kept in the loss or dropped per algorithm.zero_std_policy."""

import numpy as np
import pytest

from flowrl.rewards.base import Reward
from flowrl.trainer.trainer import FlowGRPOTrainer


class FirstPromptConstant(Reward):
    """Reward 1.0 for every sample of the step's first prompt (a zero-std group), noise otherwise."""

    name = "first_prompt_constant"

    def score_batch(self, images, prompts, metadata):
        # Decided per row (uids are "step{k}-prompt{i}"), not per scored chunk: async scoring may
        # hand any subset of the rows to one call.
        rng = np.random.default_rng()
        return np.array([1.0 if m["uid"].endswith("prompt0") else rng.normal() for m in metadata])


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_zero_std_policy(make_cfg, policy):
    cfg = make_cfg("rollout.n=2", "trainer.prompts_per_step=2", f"algorithm.zero_std_policy={policy}")
    trainer = FlowGRPOTrainer(cfg, reward=FirstPromptConstant())
    metrics = trainer.train_step()
    assert metrics["adv/zero_std_ratio"] == 0.5
    assert metrics["adv/num_rows_trained"] == (4 if policy == "keep" else 2)
    assert metrics["actor/num_optimizer_steps"] == 1 and trainer.policy_version == 1
