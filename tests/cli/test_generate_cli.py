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


def test_generate_writes_a_video_models_samples_as_mp4(tmp_path, capsys):
    """A Wan model's samples are videos: one mp4 each, at --num-frames (it once crashed handing
    (F, 3, H, W) frames to PIL); a frame count the VAE cannot make is refused naming the flag."""
    from flowrl.data.video_files import decode_mp4
    from flowrl.models.debug.tiny import build_tiny_checkpoint

    model = build_tiny_checkpoint("wan", tmp_path / "wan", seed=0)
    out = tmp_path / "out"
    argv = ["--model", str(model), "--prompt", "a red circle", "-n", "2", "--steps", "2", "--height", "32"]
    argv += ["--width", "48", "--num-frames", "9", "--fps", "8", "--out", str(out)]
    assert main(["generate", *argv]) == 0
    videos = sorted(out.glob("*.mp4"))
    assert len(videos) == 2 and not list(out.glob("*.png"))
    assert decode_mp4(videos[0].read_bytes()).shape == (9, 3, 32, 48)
    assert json.loads((out / "stats.json").read_text())["sampling"]["num_frames"] == 9
    capsys.readouterr()
    bad = [*argv[:-2], "--out", str(tmp_path / "bad")]
    bad[bad.index("--num-frames") + 1] = "8"
    assert "--num-frames 8 is not of the form 4k+1" in _error_line(capsys, bad)
