"""The Wan tests' one training config: a tiny Wan checkpoint trained on 32x32, 5-frame clips with
CFG 4.5 and a per-frame, weight-free reward, no validation or checkpoints (overrides on top)."""

from __future__ import annotations

SIZE, FRAMES = 32, 5


def wan_train_config(path, output, *overrides):
    from small_runs import small_run_config

    sampling = [f"height={SIZE}", f"width={SIZE}", f"num_frames={FRAMES}", "guidance_scale=4.5"]
    return small_run_config(
        path,
        output,
        "reward.name=per_frame",
        "reward.options.reward=jpeg_compressibility",
        *[f"rollout.sampling.{s}" for s in sampling],
        *[f"rollout.val_sampling.{s}" for s in sampling],
        *overrides,
    )
