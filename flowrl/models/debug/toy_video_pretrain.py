"""Pretraining the video toy model on the video world's pretraining split, as the image toy model
is pretrained (flowrl.models.debug.toy_pretrain, whose learning-rate schedule and flow-matching
transformer training it reuses):

1. `render_clips`: `num_clips` (caption, clip) pairs of the pretraining split.
2. `train_video_autoencoder`: AutoencoderKLWan on freshly drawn clips of every caption (a codec
   must show what RL asks for; flowrl.data.toy_video_split), L1 + MSE reconstruction and a small
   KL term, object pixels weighted up (`_OBJECT_WEIGHT`). The decoder is trained on the encoder's
   means, not on samples of its posterior (the transformer learns the means anyway): decoding
   posterior samples, or means plus noise, left every object one average brown in short trials
   where decoding the means drew the colours (docs/learning.md). Then the per-channel `latents_mean` /
   `latents_std` from the encoder's latents of the pool, so the transformer sees latents of zero
   mean and unit variance, as Wan's do.
3. The transformer: toy_pretrain.train_transformer on the clips' latents and the UMT5's features
   of their captions, as WanPipeline encodes them for sampling.

`build_video_toy_pipeline(size, seed)` runs the three, or the first and last under an autoencoder
already trained (`codec`, which flowrl.models.debug.toy loads); the same seed and machine (device
and thread count) give the same weights. It knows nothing about files.
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.models.debug.toy_pretrain import autoencoder_step, learning_rate, to_model_range, train_transformer
from flowrl.models.debug.toy_video_modules import TEXT_LENGTH, VideoToySize, build_video_pipeline

_KL_WEIGHT = 1e-5
# A clip is mostly background (an object covers about 5% of a frame): unweighted, a small
# autoencoder first learns to draw white frames and stays there for hundreds of steps.
_OBJECT_WEIGHT = 4.0


def render_clips(size: VideoToySize, num: int, seed: int, bar=None) -> tuple[list[str], torch.Tensor]:
    """(captions, (N, 3, F, H, W) uint8 clips) of the pretraining split."""
    from flowrl.data.toy_video_split import pretraining_clips

    side = size.image_size
    captions, clips = [], np.empty((num, size.num_frames, side, side, 3), dtype=np.uint8)
    for index, (caption, clip) in enumerate(pretraining_clips(num, seed, side, size.num_frames)):
        captions.append(caption)
        clips[index] = clip
        if bar is not None:
            bar.update(1)
    return captions, torch.from_numpy(clips).permute(0, 4, 1, 2, 3).contiguous()


def decode_unclamped(vae, latents: torch.Tensor) -> torch.Tensor:
    """(N, 3, F, H, W): what `vae.decode` returns before it clamps to [-1, 1]. Trained through the
    clamp, a pixel decoded beyond the range gets no gradient and stays wrong (an object's colour
    channel above 1 never comes back), so the loss reads the decoder's own outputs, one per
    latent frame, as decode's loop produces them."""
    chunks = []
    handle = vae.decoder.register_forward_hook(lambda module, args, output: chunks.append(output))
    try:
        vae.decode(latents)
    finally:
        handle.remove()
    return torch.cat(chunks, dim=2)


def train_video_autoencoder(vae, clips: torch.Tensor, size: VideoToySize, seed: int, device, bar=None) -> None:
    """Train `vae` in place on clips of the whole world drawn from `seed`, then set its latent
    mean and std from `clips`' latents (module docstring)."""
    from flowrl.data.toy_video_split import codec_clips

    vae.to(device).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=size.vae_lr, weight_decay=0.0)
    drawn = codec_clips(size.vae_steps * size.vae_batch, seed, size.image_size, size.num_frames)
    for step in range(size.vae_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, size.vae_steps, size.vae_lr)
        batch = torch.from_numpy(np.stack([next(drawn) for _ in range(size.vae_batch)])).permute(0, 4, 1, 2, 3)
        videos = to_model_range(batch, device)
        posterior = vae.encode(videos).latent_dist
        reconstruction = decode_unclamped(vae, posterior.mean)
        weight = 1.0 + _OBJECT_WEIGHT * (videos < 1.0).any(dim=1, keepdim=True)  # object pixels count more
        error = (reconstruction - videos) * weight
        loss = error.abs().mean() + error.pow(2).mean() + _KL_WEIGHT * posterior.kl().mean()
        autoencoder_step(vae, optimizer, loss, step, bar)
    vae.eval().requires_grad_(False)
    latents = encode_clips(vae, clips[: min(len(clips), 1024)], device, scaled=False)
    vae.register_to_config(
        latents_mean=latents.mean(dim=(0, 2, 3, 4)).tolist(), latents_std=latents.std(dim=(0, 2, 3, 4)).tolist()
    )


@torch.no_grad()
def encode_clips(vae, clips: torch.Tensor, device, scaled: bool = True, chunk: int = 64) -> torch.Tensor:
    """(N, C, f, h, w) float32 latents (the encoder's means), normalized as WanPipeline's when `scaled`."""
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=device).view(shape)
    parts = []
    for start in range(0, len(clips), chunk):
        latents = vae.encode(to_model_range(clips[start : start + chunk], device)).latent_dist.mean.float()
        parts.append((latents - mean) / std if scaled else latents)
    return torch.cat(parts)


@torch.no_grad()
def encode_motion_captions(pipeline, captions: list[str], device) -> dict[str, dict[str, torch.Tensor]]:
    """{caption: {"encoder_hidden_states": (L, D)}} as WanPipeline encodes them for sampling."""
    unique = sorted(set(captions) | {""})
    embeds, _ = pipeline.encode_prompt(
        prompt=unique, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH, device=device
    )
    return {text: {"encoder_hidden_states": embeds[i]} for i, text in enumerate(unique)}


def build_video_toy_pipeline(size: VideoToySize, seed: int, device, bar, codec=None):
    """The pretrained WanPipeline in memory (float32, CPU); torch's RNG must be forked and seeded
    by the caller. `bar(total, phase)` makes a progress bar for each phase. `codec`: a trained
    AutoencoderKLWan of `size`'s architecture, used as it is instead of training one."""
    pipeline = build_video_pipeline(size)
    if codec is not None:
        pipeline.vae = codec
    generator = torch.Generator().manual_seed(seed)
    with bar(size.num_clips, "rendering") as phase:
        captions, clips = render_clips(size, size.num_clips, seed, phase)
    pipeline.text_encoder.to(device)
    text = encode_motion_captions(pipeline, captions, device)
    if codec is None:
        with bar(size.vae_steps, "autoencoder") as phase:
            train_video_autoencoder(pipeline.vae, clips, size, seed + 1, device, phase)
    pipeline.vae.to(device).eval().requires_grad_(False)
    latents = encode_clips(pipeline.vae, clips, device)
    with bar(size.steps, "transformer") as phase:
        pipeline.transformer = train_transformer(
            pipeline.transformer, latents, captions, text, size, generator, device, phase
        )
    return pipeline.to("cpu")
