"""A validation pass: the validation prompts sampled with fixed seeds (rollout.val_sampling: ODE),
scored (each component of a reward with several: val/reward/<name>/mean), and drawn as a
captioned grid.

`validate(...)` samples this rank's share of the prompts through an agent loop (the trainer's own
engine, whatever backend its training rollouts use), scores them with the reward, gathers every
rank's share, and on rank 0 writes `val/step_XXXXXX.png` (each image captioned with its prompt, its
target text when the row has `ground_truth`, and its score; a video model's samples are frame
strips there, and each video an mp4 in `val/step_XXXXXX_videos/`). Which weights it samples with is the
caller's context (`weights`: e.g. the moving average of trainer.ema, and a sharded model's
gathered weights); a stop signal ends the wait for the samples inside that context, whose exit
restores the weights. It knows the agent loop, the reward and the world; nothing of training.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from flowrl.data.video_files import encode_mp4, frame_strip
from flowrl.rollout.batch import RolloutBatch
from flowrl.run.metrics import grid_captions, save_image_grid
from flowrl.waiting import call_abortably


def _save_videos(videos: torch.Tensor, grid: Path) -> None:
    """Each validation video (F, 3, H, W) as `<grid stem>_videos/<row>.mp4` beside the grid PNG."""
    folder = Path(grid).with_name(Path(grid).stem + "_videos")
    folder.mkdir(parents=True, exist_ok=True)
    for row, video in enumerate(videos):
        (folder / f"{row}.mp4").write_bytes(encode_mp4(video))


def validate(agent_loop, rows: list[dict], reward, world, weights, grid: Path | None, progress, stop_check=None):
    """Sample, score and draw the validation `rows` (module docstring). weights: the context the
    samples are drawn in (every rank enters it: a collective when sharded); grid: where rank 0
    writes the grid PNG; progress: the run's bar (flowrl.run.progress). Returns (metrics over every
    rank's rows, the grid image on rank 0 or None, the number of images)."""
    t0 = time.perf_counter()
    first, mine = world.share(rows)
    progress.phase("validation", len(mine))
    images, scores, prompts, targets, components = None, [], [], [], {}
    with weights:
        if mine:
            batch = RolloutBatch.from_rows([dict(row) for row in mine])
            out = agent_loop.generate_sequences(
                batch,
                validation=True,
                on_sample_done=lambda row, output: progress.advance(),
                row_offset=first,
                stop_check=stop_check,
            )
            images = out.batch["images"]
            prompts = [str(p) for p in out.non_tensor_batch["raw_prompt"]]
            targets = list(out.non_tensor_batch.get("ground_truth", [None] * len(out)))
    if mine:
        metadata = [out.row_metadata(i) for i in range(len(out))]
        scored = call_abortably(_score, reward, images, prompts, metadata, stop_check=stop_check)
        scores, components = list(scored[0]), {name: list(values) for name, values in scored[1].items()}
    shares = [share for share in world.gather((images, scores, prompts, targets, components)) if share[0] is not None]
    scores = np.concatenate([np.asarray(share[1], dtype=np.float64) for share in shares])
    image = None
    if world.is_main:
        prompts = [p for share in shares for p in share[2]]
        targets = [t for share in shares for t in share[3]]
        samples = torch.cat([share[0] for share in shares])
        if samples.dim() == 5:  # videos: frame strips in the grid, each video an mp4 beside it
            _save_videos(samples, grid)
            samples = torch.stack([torch.from_numpy(frame_strip(video.numpy())) for video in samples])
        image = save_image_grid(
            samples,
            grid_captions(prompts, scores, targets if any(t is not None for t in targets) else None),
            grid,
        )
    scored = scores[~np.isnan(scores)]  # no NaN-mean warning when every reward failed: NaN
    metrics = {
        "val/reward_mean": float(scored.mean()) if scored.size else float("nan"),
        "val/reward_std": float(scored.std()) if scored.size else float("nan"),
        "timing/val_s": time.perf_counter() - t0,
    }
    for name in sorted({name for share in shares for name in share[4]}):
        values = np.asarray([v for share in shares for v in share[4].get(name, [])], dtype=np.float64)
        values = values[~np.isnan(values)]
        metrics[f"val/reward/{name}/mean"] = float(values.mean()) if values.size else float("nan")
    return metrics, image, len(scores)


def _score(reward, images, prompts, metadata) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(totals, {component: scores}): the components only for a reward with several (the toy
    world's partial and strict scores, a weighted sum's parts), none when a row failed (an optional
    reward's failed rows are NaN, as in training)."""
    from flowrl.rewards import RewardError

    try:
        total, components = reward.score_with_components(images, prompts, metadata)
    except RewardError:
        return reward.score_or_nan(images, prompts, metadata)[0], {}
    return total, components if len(components) > 1 else {}
