"""Validation grids: every image is captioned with its prompt, its target text (rows with
`ground_truth`) and its reward, each caption line cut to the cell's width."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image, ImageDraw

from flowrl.rollout import validation as validation_module
from flowrl.run.metrics import _fit_line, grid_captions, save_image_grid


def test_captions_hold_prompt_target_and_reward():
    captions = grid_captions(["a sign", "a cat"], [0.5, -0.125], ["OPEN", None])
    assert captions == ["a sign\ntarget: 'OPEN'\nreward 0.5", "a cat\nreward -0.125"]


def test_grid_draws_every_caption_line_within_its_cell(tmp_path):
    images = np.full((2, 3, 64, 64), 128, dtype=np.uint8)
    long_prompt = "a very long prompt about a lighthouse on a cliff at dusk with seagulls and a red boat"
    path = save_image_grid(images, grid_captions([long_prompt, "x"], [1.0, 2.0], ["HELLO", None]), tmp_path / "g.png")
    grid = np.asarray(Image.open(path).convert("L"))
    cell = 192  # 64 px images are upscaled to the minimum cell width
    caption = grid[cell:, :]
    assert grid.shape[1] == 2 * cell and caption.shape[0] > 30  # room for three lines
    inked = np.flatnonzero((caption[:, :cell] < 128).any(axis=1))  # caption rows of the first cell with text
    assert 1 + int((np.diff(inked) > 1).sum()) == 3  # three separate lines: prompt, target, reward
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    cut = _fit_line(draw, long_prompt, cell - 4)
    assert cut.endswith("...") and draw.textlength(cut) <= cell - 4


def test_validation_grid_shows_the_rows_target_text(build_trainer, make_cfg, tmp_path, monkeypatch):
    rows = [{"prompt": "a sign that says 'OPEN'", "ground_truth": "OPEN"}, {"prompt": "a cat", "ground_truth": "CAT"}]
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = []
    monkeypatch.setattr(validation_module, "grid_captions", lambda *a: seen.append(grid_captions(*a)) or seen[-1])
    cfg = make_cfg(f"data.train_path={data}", "trainer.num_val_images=2", "rollout.n=2", "trainer.prompts_per_step=2")
    result = build_trainer(cfg).validate()
    assert (tmp_path / "run" / "val" / "step_000000.png").is_file() and "val/reward_mean" in result
    assert [caption.split("\n")[:2] for caption in seen[0]] == [
        [r["prompt"], f"target: {r['ground_truth']!r}"] for r in rows
    ]
