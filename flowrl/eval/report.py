"""What `flowrl eval` writes and prints: the JSON report, the comparison grid, the table.

- `eval_report.json`: the settings (model, prompts, sampling, seeds, rewards), per source the
  summary of flowrl.eval.evaluate.summarize, and per prompt its seeds and every source's scores.
- `grid.png`: one row per (prompt, sample), one column per source (the base first), so each row
  compares the same seed across weights; under each image its prompt and scores.
- `format_table`: per reward, one line per source with its mean, interval and difference to base.

It knows the results' structure, nothing about models or sampling.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

REPORT_FILE = "eval_report.json"
GRID_FILE = "grid.png"


def _plain(value):
    """JSON-ready: numpy to Python, NaN/inf to null (JSON has no NaN)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def build_report(settings: dict, rows: list[dict], results, summary: list[dict]) -> dict:
    per_prompt = []
    for index, row in enumerate(rows):
        entry = {"index": index, "prompt": row["raw_prompt"], "seeds": results[0].seeds[index]}
        if row.get("ground_truth") is not None:
            entry["ground_truth"] = row["ground_truth"]
        entry["scores"] = {r.source.label: {name: s[index] for name, s in r.scores.items()} for r in results}
        per_prompt.append(entry)
    return _plain({**settings, "evaluations": summary, "per_prompt": per_prompt})


def write_report(out_dir: Path, report: dict) -> Path:
    path = out_dir / REPORT_FILE
    path.write_text(json.dumps(report, indent=1))
    return path


def _number(value) -> str:
    return "nan" if value is None else f"{value:.4g}"


def _with_interval(stats: dict, signed: bool = False) -> str:
    mean = stats["mean"]
    text = "nan" if mean is None else (f"{mean:+.4g}" if signed else f"{mean:.4g}")
    if stats["ci95"] is not None:
        low, high = stats["ci95"]
        text += f" [{low:+.4g}, {high:+.4g}]" if signed else f" [{low:.4g}, {high:.4g}]"
    return text


def format_table(summary: list[dict]) -> str:
    """Per reward column: a header, then one line per source (module docstring)."""
    columns = list(summary[0]["scores"])
    width = max(len("weights"), *(len(entry["label"]) for entry in summary)) + 2  # never run into the next
    lines = []
    for column in columns:
        header = column + ": mean [95% CI]"
        cells = [_with_interval(entry["scores"][column]) for entry in summary]
        scores_width = max(40, *(len(text) + 2 for text in (header, *cells)))
        lines.append(f"{'weights':<{width}}{header:<{scores_width}}vs base: difference [95% CI]")
        for entry, cell in zip(summary, cells):
            delta = entry.get("vs_base", {}).get(column)
            line = f"{entry['label']:<{width}}{cell:<{scores_width}}"
            lines.append(line + (_with_interval(delta, signed=True) if delta else ""))
    return "\n".join(lines)


def _wrap(draw, text: str, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels, at most `max_lines` lines (the last one cut with ...)."""
    lines, current = [], ""
    for word in text.split():
        trial = f"{current} {word}".strip()
        if draw.textlength(trial) <= width or not current:
            current = trial
        else:
            lines.append(current)
            current = word
    lines.append(current)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        while lines[-1] and draw.textlength(lines[-1] + "...") > width:
            lines[-1] = lines[-1][:-1]
        lines[-1] += "..."
    return lines


def save_comparison_grid(results, rows: list[dict], samples_per_prompt: int, path: Path) -> Path | None:
    """The grid of the module docstring from each result's `grid_images`; None when empty."""
    from PIL import Image, ImageDraw

    count = len(results[0].grid_images)
    if count == 0:
        return None
    height, width = results[0].grid_images[0].shape[1:]
    cell_w = min(max(width, 128), 256)  # small images grow (nearest), large ones shrink
    cell_h = round(height * cell_w / width)
    line_h, header_h = 12, 16
    caption_lines = 3 + len(results[0].scores)
    caption_h = line_h * caption_lines + 4
    grid = Image.new("RGB", (len(results) * cell_w, header_h + count * (cell_h + caption_h)), "white")
    draw = ImageDraw.Draw(grid)
    for column, result in enumerate(results):
        x = column * cell_w
        draw.text((x + 2, 2), result.source.label, fill="black")
        for index, image in enumerate(result.grid_images):
            y = header_h + index * (cell_h + caption_h)
            tile = Image.fromarray(image.permute(1, 2, 0).numpy())
            resample = Image.NEAREST if cell_w >= width else Image.LANCZOS
            grid.paste(tile.resize((cell_w, cell_h), resample), (x, y))
            prompt_index, sample = divmod(index, samples_per_prompt)
            text = _wrap(draw, str(rows[prompt_index]["raw_prompt"]), cell_w - 4, 3)
            text += [f"{name}={_number(_finite(s[prompt_index, sample]))}" for name, s in result.scores.items()]
            for line_index, line in enumerate(text):
                draw.text((x + 2, y + cell_h + 2 + line_index * line_h), line, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def _finite(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
