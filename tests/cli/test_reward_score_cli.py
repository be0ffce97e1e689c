"""`flowrl reward-score` through the real entry point (in-process: flowrl.cli.main)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from flowrl.cli import main
from flowrl.data.render_text import render_text_image


def _save(array_chw: np.ndarray, path):
    Image.fromarray(array_chw.transpose(1, 2, 0)).save(path)
    return str(path)


def test_prints_one_score_per_image_in_order(tmp_path, capsys):
    flat = _save(np.full((3, 32, 32), 128, np.uint8), tmp_path / "flat.png")
    noise = _save(np.random.default_rng(0).integers(0, 256, (3, 48, 40), dtype=np.uint8), tmp_path / "noise.png")
    assert main(["reward-score", "--reward", "jpeg_compressibility", "--option", "quality=90", flat, noise, flat]) == 0
    lines = capsys.readouterr().out.split()
    scores = [float(line) for line in lines]
    assert len(scores) == 3 and scores[0] == scores[2] > scores[1]


def test_ocr_with_ground_truth(tmp_path, capsys):
    sign = _save(render_text_image("OPEN NOW"), tmp_path / "sign.png")
    assert main(["reward-score", "--reward", "ocr", "--ground-truth", "open now", sign]) == 0
    assert capsys.readouterr().out.split() == ["1"]


def test_bad_input_exits_2_and_a_failed_reward_1_with_a_message(tmp_path, capsys):
    image = _save(np.zeros((3, 8, 8), np.uint8), tmp_path / "x.png")
    assert main(["reward-score", "--reward", "nope", image]) == 2
    assert "unknown reward name 'nope'" in capsys.readouterr().err
    assert main(["reward-score", "--reward", "jpeg_compressibility", "--option", "quality", image]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(["reward-score", "--reward", "jpeg_compressibility", str(tmp_path / "missing.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["reward-score", "--reward", "ocr", image]) == 1  # the reward itself failed: no ground_truth
    assert "reward 'ocr' failed on row 0" in capsys.readouterr().err
    spec = tmp_path / "recipe.yaml"
    spec.write_text("reward:\n  name: null\n  components:\n    - {name: jpeg_compressibility, weight: 2.0}\n")
    assert main(["reward-score", "--spec-file", str(spec), image]) == 0
    assert float(capsys.readouterr().out) < 0
