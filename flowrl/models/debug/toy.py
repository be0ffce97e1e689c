"""The toy world's pretrained model: `make_toy_checkpoint(out, size, seed)` builds and saves it.

A StableDiffusion3Pipeline folder (flowrl.models.debug.toy_modules' architecture) whose
autoencoder and transformer are pretrained on the toy world's pretraining split
(flowrl.models.debug.toy_pretrain), loadable with `model.path=` like any checkpoint and with
`StableDiffusion3Pipeline.from_pretrained`. Two sizes (`SIZES`): "cpu", small enough to commit
(`committed_checkpoint()`, the README's main job and CI use it), and "gpu", larger, for one GPU.
The model draws the world's shapes and colours but not every composition it was never shown,
which is what RL on the held-out prompts has to teach. "video-cpu" is the video toy world's model
(flowrl.models.debug.toy_video_pretrain): a WanPipeline of 5-frame clips, committed too
(`committed_checkpoint("video-cpu")`); "video-gpu" is its larger size for one GPU.

`steps` and `batch` replace the size's transformer pretraining budget (a weaker or stronger base
of the same architecture). The folder follows flowrl.output_paths: a `.flowrl-toy` marker records
the size, the seed, the pretraining budget (the transformer's and the autoencoder's) and the
files; a folder already holding the same is kept as it is, flowrl's own earlier toy build is
replaced, anything else is refused unless `overwrite`. The same seed on the same machine (device
and thread count) gives the same weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from pathlib import Path

import torch

from flowrl.models.debug.toy_modules import ToySize
from flowrl.models.debug.toy_video_modules import VideoToySize
from flowrl.output_paths import check_output_folder, file_sizes, read_marker, remove_listed_files, write_marker

TOY_MARKER = "toy"  # the folder's marker file: .flowrl-toy
COMMITTED_DIRNAMES = {"cpu": "toy_cpu", "video-cpu": "toy_video_cpu"}

SIZES: dict[str, ToySize | VideoToySize] = {
    # 48 x 48 pictures, 8x autoencoder: a 6 x 6 latent whose 2 x 2 patches are the world's 3 x 3
    # grid cells, so each of the transformer's 9 image tokens draws one cell.
    "cpu": ToySize(
        name="cpu",
        image_size=48,
        vae_channels=(16, 32, 32, 32),
        latent_channels=4,
        num_layers=4,
        num_heads=3,
        head_dim=32,
        num_images=30_000,
        vae_steps=1200,
        vae_batch=32,
        vae_lr=2e-3,
        steps=4000,
        batch=128,
        lr=1e-3,
        ema_decay=0.999,
    ),
    "gpu": ToySize(
        name="gpu",
        image_size=48,
        vae_channels=(32, 64, 64, 64),
        latent_channels=4,
        num_layers=8,
        num_heads=8,
        head_dim=32,
        num_images=100_000,
        # Its eager training step is bound by launching small operators, not by its rows, so it
        # takes few, large steps (benchmarks/results/2026-12-05_toy-gpu_h100.md); 1,000 of them
        # leave its held-out compositions imperfect, as the world asks (2026-12-05_toy-gpu-budget_h100.md).
        vae_steps=1000,
        vae_batch=384,
        vae_lr=2e-3,
        steps=1000,
        batch=2048,
        lr=1e-3,
        ema_decay=0.999,
    ),
    # 5-frame 48 x 48 clips, Wan's 4x temporal and 8x spatial autoencoder: a (16, 2, 6, 6) latent
    # whose 2 x 2 patches are the grid cells, the first frame's and the four after it.
    "video-cpu": VideoToySize(
        name="video-cpu",
        image_size=48,
        num_frames=5,
        vae_base_dim=8,
        vae_dim_mult=(1, 2, 2, 2),
        latent_channels=16,
        num_layers=4,
        num_heads=4,
        head_dim=16,
        ffn_dim=256,
        num_clips=8192,
        # Shapes need the autoencoder's long run at a moderate rate: shorter or faster ones keep
        # colour and motion but lose most shapes in a round trip (benchmarks/toy_video_codec.py;
        # benchmarks/results/2026-12-05_toy-video-codec_toy-cpu.md).
        vae_steps=4800,
        vae_batch=8,
        vae_lr=1e-3,
        steps=4000,
        batch=128,
        lr=1e-3,
        ema_decay=0.999,
    ),
}

# The video world's GPU size, as "gpu" is the image world's: the committed video-cpu model's trained
# autoencoder itself (one codec for the world, whose round trip docs/learning.md measured; a GPU
# build then spends its minutes on the transformer) under a transformer of 28x the parameters (9.0M:
# 4x the width, 2x the depth), pretrained in few, large steps (a small model's GPU step is bound by
# launching operators, not by its rows). Not committed: `flowrl make-toy --size video-gpu`.
SIZES["video-gpu"] = dataclasses.replace(
    SIZES["video-cpu"],
    name="video-gpu",
    codec="video-cpu",
    num_layers=8,
    num_heads=8,
    head_dim=32,
    ffn_dim=1024,
    num_clips=32768,
    steps=1000,
    batch=1024,
)


def committed_checkpoint(size: str = "cpu") -> Path:
    """The committed toy model of `size` ("cpu" or "video-cpu", seed 0), inside the installed package."""
    if size not in COMMITTED_DIRNAMES:
        raise ValueError(f"size={size!r} has no committed toy model; the committed ones are {list(COMMITTED_DIRNAMES)}")
    return Path(__file__).resolve().parent / COMMITTED_DIRNAMES[size]


def resolve_size(size: str | ToySize | VideoToySize) -> ToySize | VideoToySize:
    if isinstance(size, (ToySize, VideoToySize)):
        return size
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not a toy model size; choose one of: {', '.join(SIZES)}")
    return SIZES[size]


def build_toy_pipeline(size: str | ToySize | VideoToySize, seed: int = 0, device: str = "cpu", progress: bool = True):
    """The pretrained toy pipeline in memory (float32, on the CPU; a WanPipeline for a video size);
    the caller's RNG is untouched. On a GPU it runs torch's deterministic kernels."""
    size = resolve_size(size)
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        # The same seed on the same GPU gives the same weights: deterministic kernels (cuBLAS needs
        # its workspace fixed before its first use in the process).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with deterministic_algorithms() if on_gpu else contextlib.nullcontext():
        return _build(size, seed, device, progress)


@contextlib.contextmanager
def deterministic_algorithms():
    """torch's deterministic kernels inside the block (an operator without one raises), then as before."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _build(size, seed: int, device: str, progress: bool):
    from flowrl.console import progress_bar
    from flowrl.models.debug.toy_modules import build_pipeline
    from flowrl.models.debug.toy_pretrain import (
        encode_captions,
        encode_pictures,
        render_pool,
        train_autoencoder,
        train_transformer,
    )

    def bar(total: int, phase: str):
        return progress_bar(total, f"toy {size.name} model: {phase}", disable=not progress)

    if isinstance(size, VideoToySize):
        from flowrl.models.debug.toy_video_pretrain import build_video_toy_pipeline

        codec = committed_codec(size) if size.codec else None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build_video_toy_pipeline(size, seed, device, bar, codec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = build_pipeline(size)
        generator = torch.Generator().manual_seed(seed)
        with bar(size.num_images, "rendering") as phase:
            captions, pictures = render_pool(size, size.num_images, seed, phase)
        for encoder in (pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3):
            encoder.to(device)
        text = encode_captions(pipeline, captions, device)
        with bar(size.vae_steps, "autoencoder") as phase:
            train_autoencoder(pipeline.vae, pictures, size, seed + 1, generator, device, phase)
        latents = encode_pictures(pipeline.vae, pictures, device)
        with bar(size.steps, "transformer") as phase:
            pipeline.transformer = train_transformer(
                pipeline.transformer, latents, captions, text, size, generator, device, phase
            )
    return pipeline.to("cpu")


def committed_codec(size: VideoToySize):
    """The trained autoencoder of the committed model `size.codec` names, checked to be of `size`'s
    architecture and pretraining budget."""
    from diffusers import AutoencoderKLWan

    from flowrl.models.debug.toy_video_modules import build_video_vae

    source = resolve_size(size.codec)
    trained = AutoencoderKLWan.from_pretrained(committed_checkpoint(size.codec), subfolder="vae")
    vae = build_video_vae(size)
    wanted = {k: v for k, v in vae.config.items() if not k.startswith(("_", "latents_"))}
    differing = sorted(k for k, v in wanted.items() if trained.config.get(k) != v)
    differing += [f for f in ("vae_steps", "vae_batch", "vae_lr") if getattr(source, f) != getattr(size, f)]
    if differing:
        raise ValueError(
            f"toy size {size.name!r} takes the autoencoder of {size.codec!r}, which differs in {differing}: "
            f"give the size {size.codec!r}'s autoencoder settings, or codec=None to train its own"
        )
    # Its weights and latent statistics in a module built here: the loaded one's config records
    # the folder it came from, which a saved model must not carry.
    vae.register_to_config(latents_mean=trained.config.latents_mean, latents_std=trained.config.latents_std)
    vae.load_state_dict(trained.state_dict())
    return vae


def make_toy_checkpoint(
    path: str | Path,
    size: str | ToySize | VideoToySize = "cpu",
    seed: int = 0,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
    steps: int | None = None,
    batch: int | None = None,
) -> tuple[Path, bool]:
    """Build the toy model and save it at `path` (module docstring). Returns (path, whether it
    was built: False when the folder already held this size, seed and budget)."""
    size = with_budget(resolve_size(size), steps, batch)
    path = Path(path)
    previous = read_marker(path, TOY_MARKER)
    if previous is not None and same_build(previous, size, seed):
        if all((path / name).is_file() for name in previous.get("files", [])):
            return path, False
    check_output_folder(path, TOY_MARKER, overwrite)  # raises before anything is built
    pipeline = build_toy_pipeline(size, seed, device, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".flowrl-toy-", dir=path.parent) as staging:
        staged = Path(staging)
        pipeline.save_pretrained(staged, safe_serialization=True)
        sizes = file_sizes(staged)
        path.mkdir(exist_ok=True)
        remove_listed_files(path, [name for name in (previous or {}).get("files", []) if name not in sizes])
        for name in sizes:
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged / name, path / name)
    codec = {"codec": size.codec} if getattr(size, "codec", None) else {}
    write_marker(path, TOY_MARKER, list(sizes), size=size.name, seed=seed, **budget_of(size), **codec)
    return path, True


def with_budget(size: ToySize | VideoToySize, steps: int | None, batch: int | None) -> ToySize | VideoToySize:
    """`size` with its transformer pretraining steps and batch replaced where given."""
    given = {field: value for field, value in (("steps", steps), ("batch", batch)) if value is not None}
    for field, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r} must be a positive integer (the transformer's pretraining {field})")
    return dataclasses.replace(size, **given)


# What a marker records of the pretraining budget (each `PretrainingBudget` field but caption_dropout).
BUDGET_FIELDS = ("steps", "batch", "vae_steps", "vae_batch", "vae_lr")
# The autoencoder budget a named size had before markers recorded it (where it has changed since):
# a folder with such a marker was built with these values.
_AUTOENCODER_BEFORE_RECORDED = {"video-cpu": {"vae_steps": 1200, "vae_batch": 8, "vae_lr": 3e-3}}


def budget_of(size: ToySize | VideoToySize) -> dict:
    """The budget fields a marker records for `size`."""
    return {field: getattr(size, field) for field in BUDGET_FIELDS}


def same_build(marker: dict, size: ToySize | VideoToySize, seed: int) -> bool:
    """Whether a folder's marker records this size, seed and budget (a field an older marker lacks
    held the named size's value of that time)."""
    named = {**budget_of(SIZES.get(size.name, size)), **_AUTOENCODER_BEFORE_RECORDED.get(size.name, {})}
    return (
        marker.get("size") == size.name
        and marker.get("seed") == seed
        and marker.get("codec") == getattr(size, "codec", None)
        and all(marker.get(field, named[field]) == value for field, value in budget_of(size).items())
    )
