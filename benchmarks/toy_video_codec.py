"""The video toy model's autoencoder alone: train it with the video-cpu size's settings, or with
some replaced, then measure what a round trip through it keeps of every caption's clips, by the
world's evaluator (colour, shape, motion, one object per frame, all four; and shape frame by frame).
A clip the autoencoder cannot return is out of the model's reach whatever the transformer learns
(benchmarks/results/2026-12-05_toy-video-codec_toy-cpu.md).

    OMP_NUM_THREADS=1 python benchmarks/toy_video_codec.py vae_steps=2400 vae_lr=1e-3
    python benchmarks/toy_video_codec.py --model flowrl/models/debug/toy_video_cpu   (a built model's)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
import torch


def round_trip_scores(vae, seeds: int = 2) -> dict:
    """The share of every caption's clips (`seeds` each) whose round trip keeps each requirement."""
    from flowrl.data.toy_video import render_clip
    from flowrl.data.toy_video_split import all_motion_captions
    from flowrl.models.debug.toy_pretrain import to_model_range
    from flowrl.rewards.shapes import detect_objects
    from flowrl.rewards.shapes_video import check_motion

    captions = all_motion_captions()
    held, shape_by_frame = [], []
    with torch.no_grad():
        for seed in range(seeds):
            clips = np.stack([render_clip(c, 1000 + 7 * i + seed) for i, c in enumerate(captions)])
            x = to_model_range(torch.from_numpy(clips).permute(0, 4, 1, 2, 3), "cpu")
            decoded = vae.decode(vae.encode(x).latent_dist.mean).sample
            frames = ((decoded / 2 + 0.5).clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 4, 1).numpy()
            for caption, clip in zip(captions, frames):
                found = [detect_objects(frame) for frame in clip]
                held.append(check_motion(found, caption, clip.shape[2], 0.25))
                shape_by_frame.append([bool(o) and max(o, key=lambda d: d.area).shape == caption.shape for o in found])
    kept = np.array(held, dtype=float)
    names = ("colour", "shape", "motion", "total")
    return {
        **{name: round(float(kept[:, i].mean()), 3) for i, name in enumerate(names)},
        "all": round(float(kept.all(axis=1).mean()), 3),
        "shape_by_frame": np.array(shape_by_frame, dtype=float).mean(axis=0).round(2).tolist(),
        "clips": len(kept),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", help="FIELD=VALUE replacing the video-cpu size's (vae_steps=2400 ...)")
    parser.add_argument("--object-weight", type=float, default=None, help="the loss weight of object pixels")
    parser.add_argument("--model", help="measure this built model's autoencoder instead of training one")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from diffusers import AutoencoderKLWan

    from flowrl.models.debug import toy_video_pretrain
    from flowrl.models.debug.toy import SIZES
    from flowrl.models.debug.toy_video_modules import build_video_vae

    started = time.perf_counter()
    if args.model:
        vae, changed = AutoencoderKLWan.from_pretrained(args.model, subfolder="vae").eval(), {"model": args.model}
    else:
        size = SIZES["video-cpu"]
        fields = {}
        for setting in args.settings:
            field, _, value = setting.partition("=")
            current = getattr(size, field)  # an unknown field is an AttributeError naming it
            fields[field] = (
                tuple(int(v) for v in value.split(",")) if isinstance(current, tuple) else type(current)(value)
            )
        size = dataclasses.replace(size, **fields)
        changed = dict(fields)
        if args.object_weight is not None:
            toy_video_pretrain._OBJECT_WEIGHT = args.object_weight  # the module's constant, for this process
            changed["object_weight"] = args.object_weight
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            vae = build_video_vae(size)
        unused = torch.full((1, 3, size.num_frames, size.image_size, size.image_size), 255, dtype=torch.uint8)
        toy_video_pretrain.train_video_autoencoder(vae, unused, size, args.seed + 1, "cpu")
    seconds = time.perf_counter() - started
    print(json.dumps({"settings": changed, "seconds": round(seconds), **round_trip_scores(vae)}))


if __name__ == "__main__":
    main()
