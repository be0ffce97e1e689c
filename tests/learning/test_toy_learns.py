"""The algorithms on the committed toy model (docs/learning.md), as `flowrl bench learn` measures
it. FlowGRPO:
each recipe (full fine-tuning, LoRA) trains 40 steps, and so does its control with the advantages
shuffled; on the 192 held-out prompts the run ends above its control, prompt by prompt (a paired
95% interval above zero), and full fine-tuning also with non-overlapping intervals (measured: full
0.534 [0.492, 0.576] against 0.386 [0.350, 0.423]; LoRA's paired gap [+0.024, +0.109]). The
gain over the base is not asserted: at 40 steps it is small (+0.02, +0.01) and within its interval
of zero. The project's target, +0.10 held-out partial score over the base within a CI budget, is not
reached yet (full: about +0.04 in 60 steps at seed 42, none at seeds 1 and 2; LoRA: about 0); docs/learning.md has the numbers and
what was tried. Each test takes about 1.5 minutes on one thread; LoRA's is slow-marked.
DiffusionNFT, AWM and online DPO (their toy recipes; in CI AWM's, the others slow-marked) train
20 steps each and end above their controls prompt by prompt (measured at 20 steps: paired gaps
[+0.046, +0.128], [+0.139, +0.226], [+0.011, +0.082]; benchmarks/results/2026-12-05_algorithms_toy-cpu.md), AWM and DiffusionNFT also
with non-overlapping intervals (NFT's narrowly: 0.534 [0.491, 0.578] against 0.448 [0.407, 0.488])."""

from __future__ import annotations

import pytest
from learning_runs import learned

STEPS = 40
# The base's held-out scores, shared by the tests of one process (the recipes start from the same
# model and score alike; bench learn keys each evaluation by all that).
BASELINES: dict = {}


# LoRA's run is slow-marked (about 100 s on a 2-core CI worker): full fine-tuning is its faster
# sibling here, and the LoRA path's plumbing is tested in tests/trainer.
@pytest.mark.parametrize("mode", ["full", pytest.param("lora", marks=pytest.mark.slow)])
def test_flowgrpo_ends_above_its_shuffled_advantage_control(mode, tmp_path):
    partial, shown = learned(f"toy_cpu_{mode}", mode, STEPS, tmp_path, baselines=BASELINES)
    assert partial["control_gap_interval"]["ci95"][0] > 0, shown
    if mode == "full":
        assert partial["above_control"], shown


# AWM's run is CI's learning check of the forward-process algorithms (their shared update,
# flowrl.trainer.forward_update); DiffusionNFT's and online DPO's are slow-marked (about 100 and 60
# worker-s; the suite's 10 minutes), their faster siblings the loss-formula, plumbing and resume
# tests of tests/trainer/test_diffusion_nft.py and test_online_dpo.py, and their learning measured
# over three seeds by the 100-step test below.
@pytest.mark.parametrize(
    "algorithm", [pytest.param("nft", marks=pytest.mark.slow), "awm", pytest.param("dpo", marks=pytest.mark.slow)]
)
def test_forward_process_algorithms_end_above_their_controls(algorithm, tmp_path):
    """DiffusionNFT, AWM and online DPO (recipes/toy_cpu_<algorithm>.yaml) for 20 steps each, with
    their controls: each run ends above its control prompt by prompt, and AWM and DiffusionNFT also
    with non-overlapping intervals (about a minute each)."""
    partial, shown = learned(f"toy_cpu_{algorithm}", algorithm, 20, tmp_path, baselines=BASELINES)
    assert partial["control_gap_interval"]["ci95"][0] > 0, shown
    if algorithm in ("awm", "nft"):
        assert partial["above_control"], shown


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["nft", "awm", "dpo"])
def test_forward_process_algorithms_rise_over_three_seeds_in_100_steps(algorithm, tmp_path):
    """DiffusionNFT, AWM and online DPO (their toy recipes), 100 steps at training seeds 42, 1 and 2,
    each with its control (about 11 minutes a recipe on one thread), pooled over the seeds: the
    held-out partial score rises above the base prompt by prompt (a paired interval above zero) and
    ends above the pooled control, intervals apart (measured: NFT 0.511 -> 0.577, control 0.451; AWM
    0.574, 0.434; DPO 0.557 [0.521, 0.594], control 0.458 [0.424, 0.493];
    benchmarks/results/2026-12-05_algorithms_toy-cpu.md, 2026-12-06_algorithms_toy-cpu.md). Its
    faster sibling is the 20-step test above."""
    partial, shown = learned(f"toy_cpu_{algorithm}", algorithm, 100, tmp_path, seeds=(42, 1, 2), baselines=BASELINES)
    assert partial["gain_interval"]["ci95"][0] > 0 and partial["above_control"], shown


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dance", "guard"])
def test_flowgrpo_variants_end_above_their_shuffled_advantage_controls(variant, tmp_path):
    """DanceGRPO's and GRPO-Guard's toy recipes (docs/learning.md: measured at 40 steps, dance 0.500
    against its control's 0.418, guard 0.541 against 0.464); their faster siblings are the formula and
    plumbing tests of tests/trainer/test_objectives.py and test_flow_grpo_variants.py."""
    partial, shown = learned(f"toy_cpu_{variant}", variant, STEPS, tmp_path, baselines=BASELINES)
    assert partial["control_gap_interval"]["ci95"][0] > 0, shown


@pytest.mark.slow
def test_the_readme_quotes_what_its_main_job_prints(tmp_path, capsys):
    """The README's command (a) trains recipes/toy_cpu_full.yaml; the held-out partial and strict
    scores it quotes before and after are the ones the run prints (about 2 minutes; the 40-step
    tests above are its fast siblings)."""
    import re
    from pathlib import Path

    from flowrl.cli import main

    assert main(["train", "--config", "recipes/toy_cpu_full.yaml", f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("validation at step")]
    measured = {int(re.search(r"step (\d+)", line).group(1)): line for line in printed}
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    quoted = re.search(r"0\.(\d+) before, 0\.(\d+) after\) and `strict` .*?; 0\.(\d+) before, 0\.(\d+) after\)", readme)
    assert quoted, "the README no longer quotes the main job's scores"
    before_partial, after_partial, before_strict, after_strict = (f"0.{group}" for group in quoted.groups())
    assert f"partial {before_partial}" in measured[0] and f"strict {before_strict}" in measured[0], measured
    assert f"partial {after_partial}" in measured[60] and f"strict {after_strict}" in measured[60], measured
