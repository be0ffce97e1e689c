"""Training on random weights at a named architecture (`model.path=random:NAME`): a weight-free
reward, prompts from a file, the trainer's phase timings, and the loud flags in metrics and summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flowrl.models.debug.architectures import ARCHITECTURES


def test_random_weights_train_with_a_weight_free_reward_and_a_prompt_file(build_trainer, make_cfg, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\na blue sphere\n")
    cfg = make_cfg(
        "model.path=random:tiny-qwen",
        f"data.train_path={prompts}",
        "reward.name=image_flatness",
        "algorithm.old_log_prob=recompute",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=2",
        "rollout.n=2",
        "rollout.sampling.num_inference_steps=3",
    )
    summary = build_trainer(cfg).fit()
    assert "RANDOM WEIGHTS" in capsys.readouterr().err
    assert summary["random_weights"] == "tiny-qwen" and summary["steps"] == 2
    records = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    for record in steps:
        assert record["model/random_weights"] == 1.0
        phases = [record[f"timing/{name}_s"] for name in ("rollout", "reward_wait", "old_log_prob", "update")]
        assert all(seconds >= 0 for seconds in phases) and record["timing/old_log_prob_s"] > 0
        assert 0 <= record["timing/weight_sync_s"] and sum(phases) <= record["timing/step_s"]


@pytest.mark.parametrize("name", [n for n in ARCHITECTURES if n.startswith("tiny-") and n != "tiny-qwen"])
def test_every_tiny_random_architecture_trains_a_step(build_trainer, make_cfg, name):
    """`random:NAME` works for every family with an adapter: one step of each tiny row (tiny-qwen:
    the test above), guidance as the family takes it (FLUX.1 [dev]'s embedded, the others' CFG);
    a video family's samples (one frame here) scored frame by frame."""
    video = ARCHITECTURES[name][0] in ("wan2.1", "wan2.2")
    reward = (
        ["reward.name=per_frame", "reward.options.reward=image_flatness"] if video else ["reward.name=image_flatness"]
    )
    cfg = make_cfg(
        f"model.path=random:{name}",
        *reward,
        "trainer.total_steps=1",
        "trainer.prompts_per_step=1",
        "rollout.n=2",
        "rollout.sampling.num_inference_steps=2",
        "rollout.sampling.guidance_scale=3.5",
        "model.max_sequence_length=16",
    )
    trainer = build_trainer(cfg)
    assert trainer.random_weights == name and trainer.adapter.family == ARCHITECTURES[name][0]
    metrics = trainer.train_step()
    assert metrics["model/random_weights"] == 1.0 and metrics["adv/num_rows_trained"] == 2
    assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith("actor/") and isinstance(v, float))


def test_random_name_of_another_family_fails_before_loading(make_cfg):
    from flowrl.run.checks import check_model_path

    cfg = make_cfg("model.path=random:tiny-qwen", "model.family=sd3")
    with pytest.raises(ValueError, match="model.family='sd3' but random:tiny-qwen holds a qwen_image pipeline"):
        check_model_path(cfg.model)
