"""FlowGRPO on the committed toy model (docs/learning.md), as `flowrl bench learn` measures it:
each recipe (full fine-tuning, LoRA) trains 40 steps, and so does its control with the advantages
shuffled; on the 192 held-out prompts the run ends above its control, prompt by prompt (a paired
95% interval above zero), and full fine-tuning also with non-overlapping intervals (measured: full
0.534 [0.492, 0.576] against 0.386 [0.350, 0.423]; LoRA's paired gap [+0.024, +0.109]). The
gain over the base is not asserted: at 40 steps it is small (+0.02, +0.01) and within its interval
of zero. The project's target, +0.10 held-out partial score over the base within a CI budget, is not
reached yet (full: about +0.04 in 60 steps; LoRA: about 0); docs/learning.md has the numbers and
what was tried. Each test takes about 1.5 minutes on one thread; the two run on separate workers."""

from __future__ import annotations

import pytest

from flowrl.bench.learn import final_comparison, run_learning

STEPS = 40


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_flowgrpo_ends_above_its_shuffled_advantage_control(mode, tmp_path):
    report = run_learning(
        f"recipes/toy_cpu_{mode}.yaml", [(mode, ())], STEPS, STEPS, tmp_path, samples_per_prompt=1, say=lambda _: None
    )
    partial = next(entry for entry in final_comparison(report) if entry["component"] == "partial")
    shown = {k: partial[k] for k in ("base", "final", "control", "gain_interval", "control_gap_interval")}
    assert partial["control_gap_interval"]["ci95"][0] > 0, shown
    if mode == "full":
        assert partial["above_control"], shown
