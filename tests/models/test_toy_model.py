"""The toy world's model: a short build repeats byte for byte, loads in diffusers and in flowrl at
the text length it was trained with, and make-toy refuses folders it did not write. The committed
CPU model: small, its autoencoder keeps the evaluator's verdict, and it draws familiar captions
well and held-out ones imperfectly (flowrl eval's path, ODE, fixed seeds)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch
from toy_helpers import file_hashes

from flowrl.cli import main
from flowrl.data.toy_world import world_words
from flowrl.models.debug import toy
from flowrl.models.debug.toy import SIZES, committed_checkpoint, make_toy_checkpoint
from flowrl.output_paths import OutputExistsError

SHORT = dataclasses.replace(
    SIZES["cpu"],
    name="short",
    vae_channels=(8, 8, 8, 8),
    num_layers=1,
    num_heads=2,
    head_dim=8,
    num_images=32,
    vae_steps=2,
    vae_batch=4,
    steps=3,
    batch=4,
)


@pytest.fixture(scope="module")
def short_build(tmp_path_factory):
    path, built = make_toy_checkpoint(tmp_path_factory.mktemp("toy") / "short", SHORT, seed=5, progress=False)
    assert built
    return path


def test_a_short_build_repeats_byte_for_byte(short_build, tmp_path):
    again, _ = make_toy_checkpoint(tmp_path / "again", SHORT, seed=5, progress=False)
    other, _ = make_toy_checkpoint(tmp_path / "other", SHORT, seed=6, progress=False)
    first, second, third = file_hashes(short_build), file_hashes(again), file_hashes(other)
    assert first == second
    assert (
        first["transformer/diffusion_pytorch_model.safetensors"]
        != third["transformer/diffusion_pytorch_model.safetensors"]
    )
    # The same size and seed again: kept as it is, nothing rebuilt.
    assert make_toy_checkpoint(again, SHORT, seed=5, progress=False) == (again, False)


def test_deterministic_kernels_hold_inside_the_block_only():
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(KeyError), toy.deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        raise KeyError("left by an error")
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.gpu
def test_a_gpu_build_repeats_byte_for_byte(tmp_path):
    """On a GPU make-toy runs torch's deterministic kernels: the same seed, the same bytes."""
    first, _ = make_toy_checkpoint(tmp_path / "first", SHORT, seed=5, device="cuda", progress=False)
    second, _ = make_toy_checkpoint(tmp_path / "second", SHORT, seed=5, device="cuda", progress=False)
    assert file_hashes(first) == file_hashes(second)
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the build


def test_loads_in_diffusers_and_in_flowrl_at_its_text_length(short_build):
    from diffusers import StableDiffusion3Pipeline

    from flowrl.models.registry import load_adapter

    pipeline = StableDiffusion3Pipeline.from_pretrained(short_build)
    for tokenizer in (pipeline.tokenizer, pipeline.tokenizer_3):
        for word in world_words():
            assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    image = pipeline("a red circle", num_inference_steps=2, height=48, width=48, max_sequence_length=16).images[0]
    assert image.size == (48, 48)
    adapter = load_adapter(short_build)
    assert adapter.max_sequence_length == 16 and adapter.vae_scale_factor == 8
    assert adapter.latent_shape(48, 48) == (SHORT.latent_channels, 6, 6)  # 3 x 3 patches: the world's cells
    vae = pipeline.vae.config
    assert vae.scaling_factor != 1.0 and vae.shift_factor != 0.0  # set from the trained encoder


def test_make_toy_refuses_a_folder_it_did_not_write(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    assert main(["make-toy", str(folder)]) == 2
    err = capsys.readouterr().err
    assert str(folder) in err and "--overwrite" in err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    with pytest.raises(OutputExistsError):
        make_toy_checkpoint(folder, SHORT, progress=False)
    # The command end to end, on the short size: builds, then keeps its own folder.
    monkeypatch.setitem(toy.SIZES, "cpu", SHORT)
    assert main(["make-toy", str(tmp_path / "built"), "--no-progress"]) == 0
    assert main(["make-toy", str(tmp_path / "built"), "--no-progress"]) == 0
    assert "kept as it is" in capsys.readouterr().out


def test_a_pretraining_budget_of_its_own_is_recorded_and_rebuilt(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(toy.SIZES, "cpu", SHORT)
    folder = tmp_path / "budget"
    assert main(["make-toy", str(folder), "--no-progress", "--steps", "2", "--batch", "3"]) == 0
    marker = json.loads((folder / ".flowrl-toy").read_text())
    assert (marker["steps"], marker["batch"]) == (2, 3)
    assert main(["make-toy", str(folder), "--no-progress", "--steps", "2", "--batch", "3"]) == 0
    assert "kept as it is" in capsys.readouterr().out
    # The size's own budget is another build: rebuilt, not kept.
    assert main(["make-toy", str(folder), "--no-progress"]) == 0
    assert "kept as it is" not in capsys.readouterr().out
    assert json.loads((folder / ".flowrl-toy").read_text())["steps"] == SHORT.steps
    with pytest.raises(SystemExit):
        main(["make-toy", str(folder), "--steps", "0"])
    with pytest.raises(ValueError, match="steps=0"):
        make_toy_checkpoint(folder, SHORT, steps=0, progress=False)


def test_the_marker_records_the_autoencoder_budget_and_an_older_marker_reads_as_its_time():
    """A folder is the same build only with the same autoencoder budget too; a marker written
    before that was recorded (steps and batch only) holds what its size had then: the image size's
    autoencoder is unchanged, the video size's was 1,200 steps at 3e-3 (rebuilt, not kept)."""
    for name in ("cpu", "video-cpu"):
        size = SIZES[name]
        marker = {"size": name, "seed": 0, **toy.budget_of(size)}
        assert toy.same_build(marker, size, 0)
        assert not toy.same_build({**marker, "vae_steps": size.vae_steps + 1}, size, 0)
        assert not toy.same_build({**marker, "vae_lr": size.vae_lr * 2}, size, 0)
    older = {"size": "cpu", "seed": 0, "steps": SIZES["cpu"].steps, "batch": SIZES["cpu"].batch}
    assert toy.same_build(older, SIZES["cpu"], 0)
    video = SIZES["video-cpu"]
    older_video = {"size": "video-cpu", "seed": 0, "steps": video.steps, "batch": video.batch}
    assert not toy.same_build(older_video, video, 0)
    then = dataclasses.replace(video, vae_steps=1200, vae_lr=3e-3)
    assert toy.same_build(older_video, then, 0)


def test_committed_model_is_small_and_marked():
    folder = committed_checkpoint()
    sizes = {p: p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    assert sum(sizes.values()) <= 10_000_000
    marker = (folder / ".flowrl-toy").read_text()
    assert '"size": "cpu"' in marker and '"seed": 0' in marker


def test_committed_autoencoder_keeps_the_evaluators_verdict():
    from diffusers import AutoencoderKL

    from flowrl.data.toy_render import render_caption
    from flowrl.data.toy_split import split_captions
    from flowrl.rewards.shapes import check_caption, detect_objects

    vae = AutoencoderKL.from_pretrained(committed_checkpoint(), subfolder="vae").eval()
    captions = split_captions()["val"]
    pictures = np.stack([render_caption(c, seed=i) for i, c in enumerate(captions)])
    with torch.no_grad():
        x = torch.from_numpy(pictures).permute(0, 3, 1, 2).float() / 127.5 - 1
        decoded = vae.decode(vae.encode(x).latent_dist.mean).sample
    round_trip = ((decoded / 2 + 0.5).clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()
    kept = [all(check_caption(detect_objects(p), c)) for p, c in zip(round_trip, captions)]
    assert np.mean(kept) >= 0.95


def test_flowrl_eval_of_the_toy_model_repeats_exactly(tmp_path, capsys):
    """Two identical `flowrl eval` runs of the committed model on held-out prompts give the same
    scores, image for image (ODE, fixed seeds), and report both of the evaluator's components."""
    import json

    args = [
        "eval", "--config", "recipes/toy_cpu_full.yaml", "--prompts", "flowrl/data/toy_prompts/val.jsonl",
        "--max-prompts", "12", "-n", "2", "--grid-rows", "0",
    ]  # fmt: skip
    reports = []
    for name in ("first", "second"):
        assert main([*args, "--out", str(tmp_path / name)]) == 0
        reports.append(json.loads((tmp_path / name / "eval_report.json").read_text()))
    capsys.readouterr()
    first, second = ([entry["scores"] for entry in report["per_prompt"]] for report in reports)
    assert first == second and len(first) == 12
    assert {"shapes", "shapes/partial", "shapes/strict"} <= set(first[0]["base"])


def test_the_split_is_the_one_the_committed_model_and_results_used():
    """The committed model was pretrained on this pretraining split and docs/learning.md's numbers
    were measured on these RL and held-out prompts: a change to the split (its seed, quotas or
    pairs) must rebuild the model and re-measure, and this test says so."""
    from flowrl.data.toy_split import split_captions

    split = split_captions()
    digests = {
        name: hashlib.sha256("|".join(c.text for c in split[name]).encode()).hexdigest()[:16]
        for name in ("pretrain", "train", "val")
    }
    assert digests == {"pretrain": "3377704463b50149", "train": "89eaa0f0334b86b2", "val": "c63d9395b4da5bf6"}, (
        "the toy split changed: rebuild flowrl/models/debug/toy_cpu (flowrl make-toy) and re-measure docs/learning.md"
    )
