"""Evaluation: every set of weights sampled on the same prompts and seeds, scored, summarized.

`evaluate(engine, loader, sources, rows, rewards, ...)` samples the prompt rows once per weight
source (the base first) through flowrl.eval.inference.sample_rows, so every source sees the same
seeds and deterministic (ODE) sampling gives the same numbers run after run. Each image is scored by
every reward and saved as a PNG (a video as the strip of its frames). The summary per source and reward is the mean over prompts with a
95% confidence interval; the per-prompt value is the mean over that prompt's samples, since samples
of one prompt are not independent observations. Against the base it adds the paired difference
(same prompt, same seeds) with its own interval, which is tighter than comparing two means.

The interval is the normal approximation mean +- 1.96 s / sqrt(n) (s: the sample standard
deviation over n prompts); with fewer than two finite values there is none. Failed rows of an
optional reward are NaN: left out of the statistics and counted.

It knows rewards and the engine's outputs, nothing about files other than the images it writes
(reports and grids: flowrl.eval.report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import numpy as np

from flowrl.eval.inference import sample_rows
from flowrl.eval.weights import WeightSource

Z_95 = NormalDist().inv_cdf(0.975)
_NOT_METADATA = ("raw_prompt", "sampling_overrides", "seed")


@dataclass
class SourceResult:
    """One weight source's samples: scores[reward] is (num_prompts, samples_per_prompt)."""

    source: WeightSource
    scores: dict[str, np.ndarray]
    seeds: np.ndarray  # (num_prompts, samples_per_prompt)
    image_paths: list[str]
    grid_images: list = field(
        default_factory=list
    )  # the first grid_rows images (a video's frame strip), (3, H, W) uint8


def interval(values) -> dict:
    """Mean, std, count and 95% normal-approximation interval of the finite values (module docstring)."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    count = int(finite.size)
    if count == 0:
        return {"mean": None, "std": None, "ci95": None, "n": 0, "num_nan": int(values.size)}
    mean = float(finite.mean())
    std = float(finite.std(ddof=1)) if count > 1 else None
    half = Z_95 * std / math.sqrt(count) if std is not None else None
    return {
        "mean": mean,
        "std": std,
        "ci95": None if half is None else [mean - half, mean + half],
        "n": count,
        "num_nan": int(values.size - count),
    }


def per_prompt_means(scores: np.ndarray) -> np.ndarray:
    """(num_prompts,) mean over each prompt's finite samples (NaN where none is finite)."""
    finite = np.isfinite(scores)
    counts = finite.sum(axis=1)
    sums = np.where(finite, scores, 0.0).sum(axis=1)
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def row_metadata(row: dict) -> dict:
    """What a reward sees of a prompt row (ground_truth, data_source and any other column)."""
    return {key: value for key, value in row.items() if key not in _NOT_METADATA}


def score_images(rewards: dict, images, rows: list[dict]) -> dict[str, np.ndarray]:
    """{column: (len(rows),) scores}: every reward's total, plus its components when it has several."""
    prompts = [str(row["raw_prompt"]) for row in rows]
    metadata = [row_metadata(row) for row in rows]
    columns = {}
    for name, reward in rewards.items():
        total, components = reward.score_with_components(images, prompts, metadata)
        columns[name] = total
        if len(components) > 1:
            columns.update({f"{name}/{component}": scores for component, scores in components.items()})
    return columns


def evaluate(
    engine,
    loader,
    sources: list[WeightSource],
    rows: list[dict],
    rewards: dict,
    params,
    base_seed: int,
    samples_per_prompt: int,
    image_dir: Path,
    grid_rows: int,
    progress=None,
) -> list[SourceResult]:
    """Sample and score `rows` with each source in order (module docstring). `progress(source)` is
    called before each source starts."""
    import torch
    from PIL import Image

    from flowrl.data.video_files import frame_strip

    results = []
    for source in sources:
        if progress is not None:
            progress(source)
        loader.load(source)
        folder = image_dir / source.label
        folder.mkdir(parents=True, exist_ok=True)
        columns: dict[str, list[np.ndarray]] = {}
        seeds, paths, grid = [], [], []
        for first, images, chunk_seeds in sample_rows(engine, rows, samples_per_prompt, params, base_seed):
            chunk_rows = [rows[first + k // samples_per_prompt] for k in range(len(chunk_seeds))]
            for name, scores in score_images(rewards, images, chunk_rows).items():
                columns.setdefault(name, []).append(scores)
            for k, (image, seed) in enumerate(zip(images, chunk_seeds)):
                index = first * samples_per_prompt + k
                path = folder / f"p{index // samples_per_prompt:04d}_s{index % samples_per_prompt:02d}_seed{seed}.png"
                picture = torch.from_numpy(frame_strip(image)) if image.ndim == 4 else image  # a video: its frames
                Image.fromarray(picture.permute(1, 2, 0).numpy()).save(path)
                paths.append(str(path))
                if len(grid) < grid_rows:
                    grid.append(picture.clone())
            seeds += chunk_seeds
        shape = (len(rows), samples_per_prompt)
        scores = {name: np.concatenate(parts).reshape(shape) for name, parts in columns.items()}
        results.append(SourceResult(source, scores, np.asarray(seeds).reshape(shape), paths, grid))
    return results


def summarize(results: list[SourceResult]) -> list[dict]:
    """Per source: label, what it is, and per reward column the interval of the per-prompt means
    and, against the first source (the base), the interval of the paired per-prompt differences."""
    base = results[0]
    summary = []
    for result in results:
        entry = {
            "label": result.source.label,
            "kind": result.source.kind,
            "path": None if result.source.path is None else str(result.source.path),
            "step": result.source.step,
            "ema": result.source.ema,
            "scores": {name: interval(per_prompt_means(s)) for name, s in result.scores.items()},
        }
        if result is not base and base.source.kind == "base":
            entry["vs_base"] = {
                name: interval(per_prompt_means(s) - per_prompt_means(base.scores[name]))
                for name, s in result.scores.items()
            }
        summary.append(entry)
    return summary
