"""`flowrl generate` runs end to end in-process, reports that batching happened, and rejects bad
input with one line and exit code 2 (no traceback), naming the flag."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from flowrl.cli import main


def test_generate_cli_writes_pngs_and_stats(tiny_qwen_path, tmp_path, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_qwen_path),
            "--prompt",
            "a cat",
            "--prompt",
            "a red sign",
            "-n",
            "3",
            "--steps",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 6 and Image.open(pngs[0]).size == (64, 64)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["num_samples_finished"] == 6 and stats["sampling"]["num_inference_steps"] == 3
    assert max(int(k) for k in stats["rows_per_forward_hist"]) > 1
    assert "mean rows/forward" in capsys.readouterr().out


def _error_line(capsys, argv: list[str]) -> str:
    """Run `flowrl generate argv`, expect exit 2, return its one error line."""
    try:
        code = main(["generate", *argv])
    except SystemExit as exit_:  # argparse's own errors (flowrl.cli.CommandParser)
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("flowrl generate: error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--steps", "0"], "--steps"),
        (["--height", "0"], "--height"),
        (["--width", "-16"], "--width"),
        (["--height", "40"], "--height 40 is not a multiple of 16"),
        (["--noise-level", "-1"], "--noise-level"),
        (["-n", "0"], "--num-outputs"),
        (["--ema"], "--ema"),
        (["--lora", "a", "--run", "b"], "not allowed with"),
        (["--lora", "/no/such/lora"], "--lora '/no/such/lora' not found"),
        (["--checkpoint", "."], "no state.json"),
    ],
)
def test_generate_bad_flags_exit_2_with_one_line(tiny_sd3_path, tmp_path, capsys, flags, expected):
    argv = ["--model", str(tiny_sd3_path), "--prompt", "a cat", "--out", str(tmp_path), *flags]
    assert expected in _error_line(capsys, argv)


def test_generate_model_errors_name_the_flag(tmp_path, capsys):
    base = ["--prompt", "a cat", "--out", str(tmp_path / "out")]
    missing = _error_line(capsys, ["--model", str(tmp_path / "nope"), *base])
    assert "--model" in missing and "not found" in missing and "model.path" not in missing
    hub = _error_line(capsys, ["--model", "stabilityai/stable-diffusion-3.5-medium", *base])
    assert "hub id" in hub and "hf download stabilityai/stable-diffusion-3.5-medium" in hub
    (tmp_path / "empty").mkdir()
    not_pipeline = _error_line(capsys, ["--model", str(tmp_path / "empty"), *base])
    assert "--model" in not_pipeline and "model_index.json" in not_pipeline
    assert "--model is required" in _error_line(capsys, base)


def test_generate_needs_a_prompt(tiny_sd3_path, tmp_path, capsys):
    assert "--prompt" in _error_line(capsys, ["--model", str(tiny_sd3_path), "--out", str(tmp_path)])
