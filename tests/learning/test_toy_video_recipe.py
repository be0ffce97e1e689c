"""The video toy recipes train and validate the committed toy Wan end to end on a CPU: two steps
of FlowGRPO, DiffusionNFT and AWM (recipes/toy_video_cpu_{full,nft,awm}.yaml) on 5-frame clips, scored
by shapes_video, validated on held-out prompts. Their learning is measured by `flowrl bench learn`
(docs/learning.md "The video world"): the slow tests below assert FlowGRPO's and AWM's three-seed
gains and each algorithm's separation from its control, these two-step runs being their faster
sibling."""

from __future__ import annotations

import json

import pytest
from learning_runs import learned

from flowrl.cli import main


@pytest.mark.parametrize("recipe", ["toy_video_cpu_full", "toy_video_cpu_nft", "toy_video_cpu_awm"])
def test_the_video_recipes_train_and_validate_clips(recipe, tmp_path, capsys):
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
    assert main(["train", "--config", f"recipes/{recipe}.yaml", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "validation at step 2" in printed and "strict" in printed
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/partial/mean" in " ".join(step) for step in steps)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["nft", "awm"])
def test_forward_process_algorithms_on_video_over_three_seeds(algorithm, tmp_path):
    """DiffusionNFT and AWM (recipes/toy_video_cpu_<algorithm>.yaml), 50 steps at training seeds 3,
    4 and 5 with their controls, 18 held-out prompts x 8 clips (about 8 minutes each on two
    threads), pooled over the seeds: each ends above its pooled control with intervals apart, and
    AWM's held-out partial score also rises above the base prompt by prompt (measured: AWM 0.575 ->
    0.679, +0.104 [+0.026, +0.183], control 0.490 [0.416, 0.563]; NFT 0.614, +0.039 [-0.049,
    +0.128], control 0.475; benchmarks/results/2026-12-06_toy-video-algorithms_toy-cpu.md)."""
    partial, shown = learned(
        f"toy_video_cpu_{algorithm}", algorithm, 50, tmp_path, seeds=(3, 4, 5), samples_per_prompt=8
    )
    assert partial["above_control"], shown
    if algorithm == "awm":
        assert partial["gain_interval"]["ci95"][0] > 0, shown


@pytest.mark.slow
def test_flowgrpo_on_video_over_three_seeds(tmp_path):
    """FlowGRPO (recipes/toy_video_cpu_full.yaml: the CPS step, 16 clips a prompt), 50 steps at
    training seeds 15, 16 and 17 with its control, 18 held-out prompts x 32 clips (about 20 minutes
    on two threads), pooled: the held-out partial score rises above the base prompt by prompt and
    ends above the control with intervals apart (measured: 0.569 -> 0.621, +0.053 [+0.029, +0.076],
    control 0.431 [0.387, 0.475]; benchmarks/results/2026-12-06_toy-video-algorithms_toy-cpu.md,
    section 6)."""
    partial, shown = learned("toy_video_cpu_full", "flowgrpo", 50, tmp_path, seeds=(15, 16, 17), samples_per_prompt=32)
    assert partial["above_control"] and partial["gain_interval"]["ci95"][0] > 0, shown
