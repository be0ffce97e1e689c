"""Bad input that once ended in a raw traceback with exit 1 now gets the one line every other
mistake gets: `flowrl CMD: error: ...` naming the option or setting, the value and the fix, exit 2
(issue 52). Each case runs the real entry point in-process."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.cli import main
from flowrl.rewards import Reward, register_reward, unregister_reward


class AlwaysFails(Reward):
    """A required reward that raises on every batch (a scorer with a bug, a server that went away)."""

    name = "always_fails"

    def score_batch(self, images, prompts, metadata):
        raise RuntimeError("scorer crashed")


@pytest.fixture
def paths(tmp_path, tiny_sd3_path):
    """Placeholders of the cases' arguments: {tiny}, {blocked} (a path under a regular file), broken
    copies of the tiny model ({no_vae}, {cut_header}, {cut_data}, {bad_index}) and image files."""
    (tmp_path / "a_file").write_text("")
    found = {"tiny": str(tiny_sd3_path), "blocked": str(tmp_path / "a_file" / "out"), "tmp": str(tmp_path)}
    for name in ("no_vae", "cut_header", "cut_data", "bad_index"):
        found[name] = str(shutil.copytree(tiny_sd3_path, tmp_path / name))
    shutil.rmtree(tmp_path / "no_vae" / "vae")
    weights = next((tmp_path / "cut_header" / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    weights = next((tmp_path / "cut_data" / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1000])
    (tmp_path / "bad_index" / "model_index.json").write_text('{"_class_name": ')
    rgb = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.png").write_text("not an image")
    Image.new("L", (14000, 14000)).save(tmp_path / "huge.png")  # past PIL's decompression-bomb bound
    return found


TRAIN = ["train", "model.path={tiny}", "trainer.output_dir={tmp}/run", "logging.progress_bar=false"]
CASES = {
    "clip_score without model_path": (
        [*TRAIN, "reward.name=clip_score"],
        "reward 'clip_score' needs the option(s) 'model_path'",
    ),
    "http without url": ([*TRAIN, "reward.name=http"], "reward 'http' needs the option(s) 'url'"),
    "a reward failing mid-run": (
        [*TRAIN, "reward.name=always_fails", "trainer.val_every=0", "rollout.n=2", "trainer.prompts_per_step=1"],
        "reward 'always_fails' failed on",
    ),
    "generate --out unwritable": (
        ["generate", "--model", "{tiny}", "--prompt", "a", "--out", "{blocked}"],
        "is a file, not a folder",
    ),
    "generate --device cuda without a GPU": (
        ["generate", "--model", "{tiny}", "--prompt", "a", "--device", "cuda", "--out", "{tmp}/g"],
        "--device 'cuda' but no CUDA GPU is visible",
    ),
    "generate --true-cfg-scale on a CFG family": (
        ["generate", "--model", "{tiny}", "--prompt", "a", "--true-cfg-scale", "4", "--out", "{tmp}/g"],
        "--true-cfg-scale 4.0 applies to guidance-distilled models",
    ),
    "generate --max-batch-rows 1 with CFG": (
        [
            "generate",
            "--model",
            "{tiny}",
            "--prompt",
            "a",
            "--guidance-scale",
            "4.5",
            "--max-batch-rows",
            "1",
            "--out",
            "{tmp}/g",
        ],
        "--guidance-scale 4.5 runs CFG, two rows per sample, but --max-batch-rows 1",
    ),
    "reward-score on a non-image": (
        ["reward-score", "--reward", "image_flatness", "{tmp}/text.png"],
        "cannot be read as an image",
    ),
    "reward-score on a truncated PNG": (
        ["reward-score", "--reward", "image_flatness", "{tmp}/cut.png"],
        "image file is truncated",
    ),
    "reward-score on a huge PNG": (
        ["reward-score", "--reward", "image_flatness", "{tmp}/huge.png"],
        "decompression bomb",
    ),
    "reward-score with a missing --spec-file": (
        ["reward-score", "--spec-file", "{tmp}/nope.yaml", "{tmp}/full.png"],
        "--spec-file",
    ),
    "make-tiny into an unwritable folder": (["make-tiny", "--kind", "sd3", "{blocked}"], "is a file, not a folder"),
    "data ocr into an unwritable folder": (
        ["data", "ocr", "--num", "2", "--out", "{blocked}/x.jsonl"],
        "is a file, not a folder",
    ),
    "a model with no vae/": (
        ["generate", "--model", "{no_vae}", "--prompt", "a", "--out", "{tmp}/g"],
        "has no vae/ folder",
    ),
    "a model with a truncated safetensors header": (
        ["generate", "--model", "{cut_header}", "--prompt", "a", "--out", "{tmp}/g"],
        "diffusion_pytorch_model.safetensors is truncated",
    ),
    "a model with truncated safetensors data": (
        [*TRAIN[:1], "model.path={cut_data}", *TRAIN[2:]],
        "diffusion_pytorch_model.safetensors is truncated",
    ),
    "a model with a broken model_index.json": (
        ["generate", "--model", "{bad_index}", "--prompt", "a", "--out", "{tmp}/g"],
        "model_index.json is not valid JSON",
    ),
}


@pytest.mark.parametrize("argv, expected", CASES.values(), ids=CASES.keys())
def test_bad_input_exits_2_with_one_line(paths, argv, expected, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("FLOWRL_CACHE", paths["tmp"])
    register_reward("always_fails", AlwaysFails)
    try:
        code = main([part.format(**paths) for part in argv])
    finally:
        unregister_reward("always_fails")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and errors[0].startswith(f"flowrl {argv[0]}") and expected in errors[0], err[-2000:]
    assert "Traceback" not in err
    assert not Path(paths["blocked"]).exists()
