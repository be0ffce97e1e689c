"""The video toy world's model: a short build repeats byte for byte and loads in diffusers and in
flowrl as a Wan model of 5-frame clips. The committed model: small, marked, and its autoencoder
keeps most of the evaluator's verdict."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch
from toy_helpers import file_hashes

from flowrl.data.toy_video import video_words
from flowrl.models.debug.toy import SIZES, committed_checkpoint, make_toy_checkpoint

SHORT = dataclasses.replace(
    SIZES["video-cpu"],
    name="video-short",
    vae_base_dim=4,
    num_layers=1,
    num_heads=2,
    ffn_dim=16,
    num_clips=16,
    vae_steps=2,
    vae_batch=2,
    steps=3,
    batch=4,
)


@pytest.fixture(scope="module")
def short_build(tmp_path_factory):
    path, built = make_toy_checkpoint(tmp_path_factory.mktemp("toy-video") / "short", SHORT, seed=5, progress=False)
    assert built
    return path


def test_a_short_build_repeats_byte_for_byte(short_build, tmp_path):
    again, _ = make_toy_checkpoint(tmp_path / "again", SHORT, seed=5, progress=False)
    assert file_hashes(short_build) == file_hashes(again)
    marker = (short_build / ".flowrl-toy").read_text()
    assert '"size": "video-short"' in marker and '"seed": 5' in marker


@pytest.mark.gpu
def test_a_gpu_build_repeats_byte_for_byte(tmp_path):
    """On a GPU make-toy runs torch's deterministic kernels (an operator without one raises): the
    Wan autoencoder's and transformer's training have them, and the same seed gives the same bytes
    (the check to run before `make-toy --size video-gpu` on a new machine)."""
    first, _ = make_toy_checkpoint(tmp_path / "first", SHORT, seed=5, device="cuda", progress=False)
    second, _ = make_toy_checkpoint(tmp_path / "second", SHORT, seed=5, device="cuda", progress=False)
    assert file_hashes(first) == file_hashes(second)


def test_loads_in_diffusers_and_in_flowrl_as_a_wan_model_of_clips(short_build):
    from diffusers import WanPipeline

    from flowrl.models.registry import load_adapter

    pipeline = WanPipeline.from_pretrained(short_build)
    for word in video_words():
        assert len(pipeline.tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    assert pipeline.vae.config.latents_std != [1.0] * SHORT.latent_channels  # set from the trained encoder
    adapter = load_adapter(short_build)
    assert adapter.family == "wan2.1" and adapter.max_sequence_length == 8
    assert adapter.latent_shape(48, 48, num_frames=5) == (SHORT.latent_channels, 2, 6, 6)
    latents = torch.randn(1, *adapter.latent_shape(48, 48, num_frames=5), generator=torch.Generator().manual_seed(0))
    video = adapter.decode(latents, 48, 48)
    assert video.shape == (1, 5, 3, 48, 48) and video.dtype == torch.uint8


def test_committed_model_is_small_marked_and_its_autoencoder_keeps_motion_colour_and_most_shapes():
    """The committed autoencoder keeps every clip's motion and colour and one object per frame, and
    the shape of about half (docs/learning.md: 56% of 144 clips with benchmarks/toy_video_codec.py;
    the earlier, shorter-trained codec kept 6%)."""
    from diffusers import AutoencoderKLWan

    from flowrl.data.toy_video import render_clip
    from flowrl.data.toy_video_split import all_motion_captions
    from flowrl.rewards.shapes import detect_objects
    from flowrl.rewards.shapes_video import check_motion

    folder = committed_checkpoint("video-cpu")
    assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) <= 10_000_000
    marker = (folder / ".flowrl-toy").read_text()
    assert '"size": "video-cpu"' in marker and '"seed": 0' in marker and '"vae_steps": 4800' in marker
    vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae").eval()
    captions = all_motion_captions()
    clips = np.stack([render_clip(c, seed=i) for i, c in enumerate(captions)])
    with torch.no_grad():
        x = torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
        decoded = vae.decode(vae.encode(x).latent_dist.mean).sample
    round_trip = ((decoded / 2 + 0.5).clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 4, 1).numpy()
    held = np.array(
        [check_motion([detect_objects(frame) for frame in clip], c, 48, 0.25) for clip, c in zip(round_trip, captions)]
    )
    colour, shape, motion, total = held.mean(axis=0)
    assert motion >= 0.95 and colour >= 0.95 and total >= 0.95 and shape >= 0.4, held.mean(axis=0)


def test_the_split_is_the_one_the_committed_model_and_results_used():
    """The committed video model was pretrained on this split and docs/learning.md's video numbers
    were measured on these prompts: a change to the split must rebuild the model and re-measure."""
    from flowrl.data.toy_video_split import split_motion_captions

    split = split_motion_captions()
    digests = {
        name: hashlib.sha256("|".join(c.text for c in split[name]).encode()).hexdigest()[:16]
        for name in ("pretrain", "train", "val")
    }
    assert digests == {"pretrain": "63bfceea05aaff31", "train": "510767d89c540d03", "val": "9e2d7bd0a7329de7"}, (
        "the video toy split changed: rebuild flowrl/models/debug/toy_video_cpu (flowrl make-toy --size video-cpu) "
        "and re-measure docs/learning.md"
    )


def test_the_gpu_size_builds_loads_and_its_recipe_trains_it(tmp_path, capsys):
    """The video-gpu size's architecture (its transformer's pretraining cut to two steps) builds, is
    the committed video-cpu autoencoder itself under a wider, deeper transformer, and
    recipes/toy_video_gpu_full.yaml trains and validates it; make-toy offers every size."""
    from flowrl.cli import main
    from flowrl.cli.make_toy import SIZE_NAMES
    from flowrl.models.registry import load_adapter

    assert SIZE_NAMES == tuple(SIZES)
    gpu, cpu = SIZES["video-gpu"], SIZES["video-cpu"]
    codec = ("vae_base_dim", "vae_dim_mult", "latent_channels", "vae_steps", "vae_batch", "vae_lr")
    assert all(getattr(gpu, field) == getattr(cpu, field) for field in codec)
    short = dataclasses.replace(gpu, name="video-gpu-short", num_clips=16, steps=2, batch=4)
    folder, _ = make_toy_checkpoint(tmp_path / "toy", short, seed=1, progress=False)
    assert file_hashes(folder / "vae") == file_hashes(committed_checkpoint("video-cpu") / "vae")
    assert '"codec": "video-cpu"' in (folder / ".flowrl-toy").read_text()
    adapter = load_adapter(folder)
    assert sum(p.numel() for p in adapter.transformer.parameters()) == 9_024_832
    out = tmp_path / "run"
    overrides = [
        f"model.path={folder}",
        f"trainer.output_dir={out}",
        "trainer.total_steps=1",
        "trainer.prompts_per_step=2",
        "rollout.n=4",
        "trainer.micro_batch_size=8",
        "trainer.val_every=1",
        "trainer.save_every=0",
        "trainer.num_val_images=2",
        "logging.progress_bar=false",
    ]
    assert main(["train", "--config", "recipes/toy_video_gpu_full.yaml", *overrides]) == 0
    assert "validation at step 1" in capsys.readouterr().out


def test_a_size_taking_a_committed_codec_of_another_architecture_is_refused(tmp_path):
    wider = dataclasses.replace(SIZES["video-gpu"], name="video-wide-codec", vae_base_dim=16, steps=1, batch=2)
    with pytest.raises(ValueError, match=r"takes the autoencoder of 'video-cpu', which differs in \['base_dim'\]"):
        make_toy_checkpoint(tmp_path / "toy", wider, seed=1, progress=False)
    assert not (tmp_path / "toy").exists()
