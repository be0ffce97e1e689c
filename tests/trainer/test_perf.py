"""Every training run logs each phase's throughput (and, with a measured peak, its MFU), as
torchtitan does: perf/<phase>_tflops is the algorithm's FLOPs of the phase over its seconds."""

from __future__ import annotations

import pytest

from flowrl.run.step_flops import StepPerf, UnitFlops


def test_a_step_logs_each_phases_rate_from_the_algorithms_flops(build_trainer, make_cfg):
    trainer = build_trainer(make_cfg("rollout.n=2", "trainer.prompts_per_step=2", "algorithm.old_log_prob=recompute"))
    metrics = trainer.train_step()
    flops = trainer.algorithm.phase_flops(trainer.perf.units, int(metrics["adv/num_rows_trained"]))
    for phase in ("rollout", "update"):
        assert flops[phase] > 0
        assert metrics[f"perf/{phase}_tflops"] == pytest.approx(flops[phase] / metrics[f"timing/{phase}_s"] / 1e12)
    assert metrics["perf/images_per_second"] == pytest.approx(4 / metrics["timing/step_s"])
    assert not any(key.endswith("_mfu") for key in metrics)  # no peak is measured on a CPU
    assert trainer.validate()["perf/validation_tflops"] > 0


def test_with_a_peak_the_mfu_is_the_rate_over_it():
    units = UnitFlops(10, 1, 30, 10, 1, 1, 1)
    perf = StepPerf(units, 1e12, lambda u, rows, val: {"rollout": 4e12, "update": 2e12 * rows})
    out = perf.metrics(
        {"timing/rollout_s": 2.0, "timing/update_s": 1.0, "timing/step_s": 4.0, "adv/num_rows_trained": 3}, 8
    )
    assert out["perf/rollout_tflops"] == 2.0 and out["perf/rollout_mfu"] == 2.0
    assert out["perf/update_mfu"] == 6.0 and out["perf/mfu"] == pytest.approx(10e12 / 4.0 / 1e12)
    assert out["perf/images_per_second"] == 2.0
