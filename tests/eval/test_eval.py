"""`flowrl eval` on the tiny model: base vs the LoRA of a short tiny training run gives a report
and a grid, the same numbers run after run, and every saved step of a run; bad input exits 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from flowrl.cli import main
from flowrl.eval.evaluate import interval, per_prompt_means
from flowrl.output_paths import read_marker


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"a sign that says {word}", "ground_truth": word} for word in ("OPEN", "EXIT", "CAFE")]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _eval(tmp_path, name, *flags) -> dict:
    out = tmp_path / name
    assert main(["eval", *flags, "--out", str(out)]) == 0
    return json.loads((out / "eval_report.json").read_text())


def test_eval_base_vs_lora_gives_a_report_and_a_grid_and_repeats_exactly(tiny_lora_run, prompt_file, tmp_path, capsys):
    flags = ["--model", str(tiny_lora_run.model), "--lora", str(tiny_lora_run.dir / "final" / "lora")]
    flags += [
        "--prompts",
        str(prompt_file),
        "--reward",
        "image_flatness",
        "--reward",
        "jpeg_compressibility",
        "-n",
        "2",
    ]
    report = _eval(tmp_path, "first", *flags)
    table = capsys.readouterr().out
    assert [e["label"] for e in report["evaluations"]] == ["base", "lora"]
    assert report["rewards"] == ["image_flatness", "jpeg_compressibility"]
    for entry in report["evaluations"]:
        for stats in entry["scores"].values():
            low, high = stats["ci95"]
            assert stats["n"] == 3 and low <= stats["mean"] <= high
    assert set(report["evaluations"][1]["vs_base"]) == {"image_flatness", "jpeg_compressibility"}
    assert "image_flatness: mean [95% CI]" in table and "lora" in table
    # per prompt: the same two seeds for base and LoRA, a score per sample
    first = report["per_prompt"][0]
    assert first["ground_truth"] == "OPEN" and len(first["seeds"]) == 2
    assert len(first["scores"]["lora"]["image_flatness"]) == 2
    # images and the grid: one column per weight set, one row per (prompt, sample) shown
    out = tmp_path / "first"
    assert len(list((out / "images" / "lora").glob("*.png"))) == 6
    grid = Image.open(out / "grid.png")
    assert grid.size[0] == 2 * 128 and grid.size[1] > 6 * 128
    # the trained weights change the images, on the same seeds
    base_image = np.asarray(Image.open(sorted((out / "images" / "base").glob("*.png"))[0]))
    lora_image = np.asarray(Image.open(sorted((out / "images" / "lora").glob("*.png"))[0]))
    assert not np.array_equal(base_image, lora_image)
    # the folder is marked as eval's: every file it wrote, so a re-run into it replaces them
    listed = read_marker(out, "eval")["files"]
    assert len(listed) == 12 + 2 and {"eval_report.json", "grid.png"} <= set(listed)
    # same seeds, same numbers (re-run into the same folder)
    again = _eval(tmp_path, "first", *flags)
    assert again["per_prompt"] == report["per_prompt"] and again["evaluations"] == report["evaluations"]


def test_eval_run_scores_every_saved_step_with_the_runs_reward(tiny_lora_run, prompt_file, tmp_path):
    report = _eval(tmp_path, "run", "--run", str(tiny_lora_run.dir), "--prompts", str(prompt_file))
    labels = [e["label"] for e in report["evaluations"]]
    assert labels == ["base", "step_000001", "step_000002"]  # final/ is step 2 again: not repeated
    assert report["rewards"] == ["image_flatness"] and "saved config" in report["settings_from"]
    assert report["sampling"]["noise_level"] == 0.0 and report["sampling"]["num_inference_steps"] == 6


def test_intervals():
    stats = interval([1.0, 2.0, 3.0, float("nan")])
    assert stats["n"] == 3 and stats["num_nan"] == 1 and stats["mean"] == 2.0
    half = 1.959963984540054 * 1.0 / np.sqrt(3)
    assert np.allclose(stats["ci95"], [2.0 - half, 2.0 + half])
    assert interval([5.0])["ci95"] is None and interval([])["mean"] is None
    means = per_prompt_means(np.array([[1.0, 3.0], [np.nan, 4.0], [np.nan, np.nan]]))
    assert means[0] == 2.0 and means[1] == 4.0 and np.isnan(means[2])


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--prompts", "missing.jsonl", "--reward", "image_flatness"], "--prompts"),
        (["--reward", "no_such_reward"], "unknown reward name"),
        (["--reward", "image_flatness", "--option", "ocr.x=1"], "--option"),
        (["--reward", "image_flatness", "--grid-rows", "-1"], "--grid-rows"),
    ],
)
def test_eval_bad_input_exits_2_with_one_line(tiny_sd3_path, prompt_file, tmp_path, capsys, flags, expected):
    argv = ["eval", "--model", str(tiny_sd3_path), "--prompts", str(prompt_file), "--out", str(tmp_path / "o"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("flowrl eval: error:")]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err


def test_eval_refuses_a_folder_it_did_not_write(tiny_sd3_path, prompt_file, tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep me")
    argv = ["eval", "--model", str(tiny_sd3_path), "--prompts", str(prompt_file), "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "did not write" in capsys.readouterr().err and (tmp_path / "mine.txt").is_file()


@pytest.mark.parametrize("content", ["a sign that says OPEN\n", '{"prompt": "a sign", "ground_truth": null}\n'])
def test_eval_ocr_on_rows_without_ground_truth_exits_2_before_sampling(tiny_sd3_path, tmp_path, capsys, content):
    """A row without ground_truth is named, never scored against the text "None"."""
    prompts = tmp_path / ("prompts.txt" if content.startswith("a ") else "prompts.jsonl")
    prompts.write_text(content)
    argv = ["eval", "--model", str(tiny_sd3_path), "--prompts", str(prompts), "--reward", "ocr"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--prompts {str(prompts)!r} row 0: reward 'ocr' cannot score it" in err and "'ground_truth'" in err
    assert "flowrl data ocr" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing sampled, nothing written


def test_table_columns_never_run_together():
    """Short labels ("base") once printed `weightsocr: mean`; every header word and value keeps a gap."""
    from flowrl.eval.report import format_table

    stats = {"mean": 0.5, "ci95": [0.25, 0.75]}
    long_name = "route_by_data_source/clip_score_with_a_long_label"
    summary = [
        {"label": "base", "scores": {"ocr": stats, long_name: stats}},
        {"label": "lora", "scores": {"ocr": stats, long_name: stats}, "vs_base": {"ocr": stats, long_name: stats}},
    ]
    lines = format_table(summary).splitlines()
    assert lines[0].startswith("weights  ocr: mean [95% CI]")
    assert f"{long_name}: mean [95% CI]  vs base" in lines[3]
    for line in lines:
        assert "weightsocr" not in line and "]vs" not in line and "CI]vs" not in line
