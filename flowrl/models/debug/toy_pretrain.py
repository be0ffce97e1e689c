"""Pretraining the toy model on the toy world's pretraining split: the autoencoder, then the
flow-matching transformer, both from seeded data and seeded noise (same seed and machine, same
weights).

1. `render_pool`: `num_images` (caption, picture) pairs of the pretraining split.
2. `train_autoencoder`: the AutoencoderKL on freshly drawn pictures of the whole world (every
   colour-shape pair: a codec must show what RL will ask for; flowrl.data.toy_split), L1 + MSE
   reconstruction and a small KL term, then its `shift_factor` / `scaling_factor` from the
   encoder's latents of the pool, so the transformer sees latents of zero mean and unit variance
   as SD3's do.
3. `train_transformer`: rectified flow as flowrl samples it: x_sigma = (1 - sigma) x0 + sigma
   noise, the transformer at timestep 1000 sigma predicts noise - x0 (MSE), with sigma = the
   scheduler's shift applied to u ~ U(0, 1) (the density of the sampling schedule's steps),
   captions replaced by the empty prompt a `caption_dropout` share of the time (so classifier-free
   guidance works), AdamW with warm-up and cosine decay, and an exponential moving average of
   the weights, which is what is saved. On CUDA the forward runs under bf16 autocast.

It knows the toy world's data and the modules' interfaces, nothing about files (flowrl.models.debug.toy).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from flowrl.models.debug.toy_modules import SCHEDULER_SHIFT, TEXT_LENGTH, ToySize

_KL_WEIGHT = 1e-5
_WARMUP_STEPS = 100
_LOSS_EVERY = 50  # steps between the progress bar's loss readings


def render_pool(size: ToySize, num_images: int, seed: int, bar=None) -> tuple[list[str], torch.Tensor]:
    """(captions, (N, 3, H, W) uint8 pictures) of the pretraining split."""
    from flowrl.data.toy_split import pretraining_examples

    captions, pictures = [], np.empty((num_images, size.image_size, size.image_size, 3), dtype=np.uint8)
    for index, (caption, picture) in enumerate(pretraining_examples(num_images, seed, size.image_size)):
        captions.append(caption)
        pictures[index] = picture
        if bar is not None:
            bar.update(1)
    return captions, torch.from_numpy(pictures).permute(0, 3, 1, 2).contiguous()


def to_model_range(pictures: torch.Tensor, device) -> torch.Tensor:
    return pictures.to(device, non_blocking=True).float() / 127.5 - 1.0


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < _WARMUP_STEPS:
        return peak * (step + 1) / _WARMUP_STEPS
    progress = (step - _WARMUP_STEPS) / max(1, total - _WARMUP_STEPS)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def autoencoder_step(vae, optimizer, loss: torch.Tensor, step: int, bar=None) -> None:
    """One optimizer step of an autoencoder's reconstruction `loss` (gradients clipped to norm 1),
    its loss shown on the progress bar every _LOSS_EVERY steps."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
    optimizer.step()
    if bar is not None:
        bar.update(1)
        if step % _LOSS_EVERY == 0:  # reading the loss waits for the device: not every step
            bar.set_postfix_str(f"autoencoder loss {loss.item():.4f}", refresh=False)


def train_autoencoder(
    vae, pictures: torch.Tensor, size: ToySize, seed: int, generator: torch.Generator, device, bar=None
) -> None:
    """Train `vae` in place on the whole world's pictures drawn from `seed`, then set its latent
    shift and scale from `pictures`' latents (module docstring)."""
    from flowrl.data.toy_split import codec_examples

    vae.to(device).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=size.vae_lr, weight_decay=0.0)
    drawn = codec_examples(size.vae_steps * size.vae_batch, seed, size.image_size)
    for step in range(size.vae_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, size.vae_steps, size.vae_lr)
        batch = np.stack([next(drawn) for _ in range(size.vae_batch)])
        images = to_model_range(torch.from_numpy(batch).permute(0, 3, 1, 2), device)
        posterior = vae.encode(images).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(
            posterior.mean.shape, generator=generator, device="cpu"
        ).to(device)
        reconstruction = vae.decode(latents).sample
        error = reconstruction - images
        loss = error.abs().mean() + error.pow(2).mean() + _KL_WEIGHT * posterior.kl().mean()
        autoencoder_step(vae, optimizer, loss, step, bar)
    vae.eval().requires_grad_(False)
    latents = encode_pictures(vae, pictures[: min(len(pictures), 2048)], device, scaled=False)
    vae.register_to_config(shift_factor=float(latents.mean()), scaling_factor=float(1.0 / latents.std()))


@torch.no_grad()
def encode_pictures(vae, pictures: torch.Tensor, device, scaled: bool = True, chunk: int = 256) -> torch.Tensor:
    """(N, C, h, w) float32 latents (the encoder's means), in the transformer's scale when `scaled`."""
    parts = []
    for start in range(0, len(pictures), chunk):
        latents = vae.encode(to_model_range(pictures[start : start + chunk], device)).latent_dist.mean.float()
        if scaled:
            latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        parts.append(latents)
    return torch.cat(parts)


@torch.no_grad()
def encode_captions(pipeline, captions: list[str], device) -> dict[str, dict[str, torch.Tensor]]:
    """{caption: the transformer's text inputs (encoder_hidden_states (L, D), pooled_projections (D,))}
    as the pipeline encodes them for sampling."""
    unique = sorted(set(captions) | {""})
    embeds, _, pooled, _ = pipeline.encode_prompt(
        prompt=unique,
        prompt_2=None,
        prompt_3=None,
        device=device,
        do_classifier_free_guidance=False,
        max_sequence_length=TEXT_LENGTH,
    )
    return {
        text: {"encoder_hidden_states": embeds[i], "pooled_projections": pooled[i]} for i, text in enumerate(unique)
    }


def sample_sigmas(count: int, generator: torch.Generator) -> torch.Tensor:
    """sigma = shift u / (1 + (shift - 1) u), u ~ U(0, 1): the sampling schedule's density."""
    u = torch.rand(count, generator=generator)
    return SCHEDULER_SHIFT * u / (1 + (SCHEDULER_SHIFT - 1) * u)


def train_transformer(
    transformer, latents: torch.Tensor, captions: list[str], text: dict, size: ToySize, generator, device, bar=None
):
    """Train `transformer` on (latents, captions) and return the moving average of its weights
    (a copy, in eval mode); see the module docstring. `text` maps each caption (and "") to the
    transformer's text inputs by keyword; `size` gives steps, batch, lr, caption_dropout and
    ema_decay; latents may be images (N, C, h, w) or videos (N, C, f, h, w)."""
    transformer.to(device).train().requires_grad_(True)
    average = copy.deepcopy(transformer).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=size.lr, weight_decay=0.0)
    caption_index = {caption: index for index, caption in enumerate(sorted(text))}
    text_inputs = {key: torch.stack([text[caption][key] for caption in sorted(text)]) for key in text[""]}
    rows = torch.tensor([caption_index[caption] for caption in captions])
    empty = caption_index[""]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda" else None
    kept_params, trained_params = list(average.parameters()), list(transformer.parameters())
    for step in range(size.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, size.steps, size.lr)
        index = torch.randint(len(latents), (size.batch,), generator=generator)
        text_rows = rows[index].clone()
        text_rows[torch.rand(size.batch, generator=generator) < size.caption_dropout] = empty
        x0 = latents[index].to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        sigmas = sample_sigmas(size.batch, generator).to(device)
        per_row = sigmas.view(-1, *[1] * (x0.ndim - 1))
        noisy = (1 - per_row) * x0 + per_row * noise
        conditions = {key: value[text_rows.to(device)] for key, value in text_inputs.items()}
        with autocast if autocast is not None else torch.autocast("cpu", enabled=False):
            prediction = transformer(hidden_states=noisy, timestep=sigmas * 1000.0, **conditions, return_dict=False)[0]
        loss = (prediction.float() - (noise - x0)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        decay = min(size.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(kept_params, trained_params, 1 - decay)
        if bar is not None:
            bar.update(1)
            if step % _LOSS_EVERY == 0:  # reading the loss waits for the device: not every step
                bar.set_postfix_str(f"flow loss {loss.item():.4f}", refresh=False)
    transformer.eval().requires_grad_(False)
    return average
