"""The video toy recipe trains and validates the committed toy Wan end to end on a CPU: two
FlowGRPO steps on 5-frame clips, scored by shapes_video, validated on held-out prompts (its
learning is measured by `flowrl bench learn`, docs/learning.md "The video world"; not asserted
here: no gain over the base has repeated across seeds yet)."""

from __future__ import annotations

import json

from flowrl.cli import main


def test_the_video_recipe_trains_and_validates_clips(tmp_path, capsys):
    out = tmp_path / "run"
    overrides = [
        f"trainer.output_dir={out}",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=2",
        "rollout.n=4",
        "trainer.micro_batch_size=8",
        "trainer.val_every=2",
        "trainer.save_every=0",
        "trainer.num_val_images=4",
        "logging.progress_bar=false",
    ]
    assert main(["train", "--config", "recipes/toy_video_cpu_full.yaml", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "validation at step 2" in printed and "strict" in printed
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/partial/mean" in " ".join(step) for step in steps)
