"""A resumed run against a straight one, for the algorithms' resume tests: `resume_vs_straight`
trains `steps` steps straight and 1 + (steps - 1) steps with a resume between, and returns both
runs' training metrics and their last checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowrl.run.checkpoint import latest_checkpoint


def _train_rows(cfg) -> list[dict]:
    lines = (Path(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


def resume_vs_straight(build_trainer, make_cfg, overrides, steps: int = 3):
    """(straight metrics, resumed metrics, straight checkpoint, resumed checkpoint)."""
    straight = make_cfg(*overrides, f"trainer.total_steps={steps}", f"trainer.save_every={steps}", output="straight")
    build_trainer(straight).fit()
    first = make_cfg(*overrides, "trainer.total_steps=1", "trainer.save_every=1", output="resumed")
    build_trainer(first).fit()
    second = make_cfg(
        *overrides,
        f"trainer.total_steps={steps}",
        f"trainer.save_every={steps}",
        "trainer.resume=auto",
        output="resumed",
    )
    build_trainer(second).fit()
    return (
        _train_rows(straight),
        _train_rows(second),
        latest_checkpoint(straight.trainer.output_dir),
        latest_checkpoint(second.trainer.output_dir),
    )


def assert_resumed_as_straight(build_trainer, make_cfg, overrides, keys, files, steps: int = 3) -> list[dict]:
    """The resumed run logs `keys` as the straight run does at every step and ends with the same
    tensors in each of `files` (checkpoint file names without .safetensors); returns the straight
    run's metrics."""
    a, b, ca, cb = resume_vs_straight(build_trainer, make_cfg, overrides, steps)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        for key in keys:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-9), (ra["step"], key)
    for name in files:
        wa, wb = load_file(str(ca / f"{name}.safetensors")), load_file(str(cb / f"{name}.safetensors"))
        assert wa.keys() == wb.keys()
        for key in wa:
            torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-7)
    return a
