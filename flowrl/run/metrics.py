"""Where training metrics and pictures go.

- `<output_dir>/metrics.jsonl`: one JSON object per step (always written). On resume the lines of
  steps after the checkpoint are dropped first, so the file reads like one uninterrupted run. A
  torn last line (a crash mid-write) is dropped with a warning; a damaged line elsewhere is an
  error naming the file and line.
- tensorboard event files under `<output_dir>/tensorboard` (logging.tensorboard); on resume the
  events of steps after the checkpoint are removed from the existing files, so no step is shown
  twice whichever reader loads them. wandb when logging.wandb is on (imported only then).
- `save_image_grid` / `grid_captions`: validation images captioned with prompt, target text and
  reward (PNG).
- `plot_reward_curve`: reward mean per step from metrics.jsonl (PNG), written at the end.

It knows nothing about training itself: it writes the numbers and images it is given.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _json_number(value):
    if isinstance(value, (int, np.integer)):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None  # JSON has no NaN


class MetricsLogger:
    """Appends step metrics to metrics.jsonl and mirrors scalars to tensorboard / wandb."""

    def __init__(
        self,
        output_dir: str | Path,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "flowrl",
        run_config: dict | None = None,
        resume_step: int = 0,
    ):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILE
        self._truncate_after(resume_step)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = self.output_dir / TENSORBOARD_DIR
            if resume_step:
                drop_tensorboard_events_after(tb_dir, resume_step)
            self._tb = SummaryWriter(str(tb_dir), purge_step=resume_step + 1 if resume_step else None)
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise ValueError(
                    "logging.wandb=true but wandb is not installed; `pip install wandb` or set logging.wandb=false"
                ) from None
            self._wandb = wandb_module.init(project=wandb_project, config=run_config, dir=str(self.output_dir))

    def _truncate_after(self, step: int) -> None:
        """A fresh run (step 0) starts an empty file; a resumed one keeps the lines up to `step`."""
        if not self.path.is_file():
            return
        if step == 0:
            self.path.unlink()
            return
        kept = [line for line, record in _parse_metrics(self.path) if record["step"] <= step]
        _replace_text(self.path, "".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step}
        for key, value in metrics.items():
            record[key] = (
                _json_number(value)
                if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
                else value
            )
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        scalars = {
            k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_image(self, step: int, tag: str, png_path: str | Path) -> None:
        if self._tb is not None:
            from PIL import Image

            self._tb.add_image(tag, np.asarray(Image.open(png_path).convert("RGB")), step, dataformats="HWC")
        if self._wandb is not None:
            import wandb as wandb_module

            self._wandb.log({tag: wandb_module.Image(str(png_path))}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _replace_text(path: Path, text: str) -> None:
    """Write `text` to path atomically (a crash leaves the old or the new file, never half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _parse_metrics(path: Path, warn: bool = True) -> list[tuple[str, dict]]:
    """(line, record) for every line of metrics.jsonl; see `read_metrics` for damaged lines."""
    lines = path.read_text(errors="replace").splitlines()
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    parsed = []
    for index, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an object with an integer step")
        except ValueError as error:
            if index == len(numbered) - 1:
                if not warn:
                    break
                print(
                    f"warning: {path} line {number} is incomplete (a crash mid-write?); dropped it",
                    file=sys.stderr,
                    flush=True,
                )
                break
            raise ValueError(
                f"{path} line {number} is damaged ({error}); delete or repair that line (each line is one "
                "JSON object with a step)"
            ) from None
        parsed.append((line, record))
    return parsed


def read_metrics(path: str | Path, warn: bool = True) -> list[dict]:
    """The records of a metrics.jsonl ([] when there is none). A torn last line is dropped, with a
    warning on stderr unless warn=False; a damaged line before it raises ValueError naming the file
    and line."""
    path = Path(path)
    if not path.is_file():
        return []
    return [record for _, record in _parse_metrics(path, warn)]


def drop_tensorboard_events_after(tb_dir: str | Path, step: int) -> None:
    """Rewrite the event files under tb_dir without the events of steps after `step` (a torn last
    record is dropped too); files with nothing to drop are left untouched."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for path in sorted(Path(tb_dir).rglob("events.out.tfevents.*")):
        records = list(RawEventFileLoader(str(path)).Load())
        kept = [raw for raw in records if Event.FromString(raw).step <= step]
        if len(kept) == len(records) and sum(len(r) + 16 for r in records) == path.stat().st_size:
            continue
        tmp = path.with_name(path.name + ".tmp")
        writer = RecordWriter(tmp.open("wb"))
        for raw in kept:
            writer.write(raw)
        writer.close()
        os.replace(tmp, path)


def grid_captions(prompts: list[str], scores, targets=None) -> list[str]:
    """One caption per image: its prompt, the target text when the row has one (`ground_truth`,
    e.g. what OCR should read), and its reward; lines separated by newlines."""
    captions = []
    for index, (prompt, score) in enumerate(zip(prompts, scores)):
        target = None if targets is None else targets[index]
        lines = [str(prompt)]
        if target not in (None, ""):
            lines.append(f"target: {target!r}" if isinstance(target, str) else f"target: {target}")
        lines.append(f"reward {float(score):.4g}")
        captions.append("\n".join(lines))
    return captions


def _fit_line(draw, text: str, width: int) -> str:
    """`text` cut (with "...") to fit `width` pixels."""
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def save_image_grid(images, captions: list[str], path: str | Path, columns: int = 4, min_cell: int = 192) -> Path:
    """images (B, 3, H, W) uint8 (numpy or torch) -> one PNG grid, each cell captioned below.

    A caption may hold several lines (see `grid_captions`); each line is cut to the cell's width.
    Small images are upscaled (nearest) to at least `min_cell` pixels wide, so captions fit."""
    from PIL import Image, ImageDraw

    images = np.asarray(images.cpu() if hasattr(images, "cpu") else images)
    if images.ndim != 4 or images.shape[1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be (B, 3, H, W) uint8, got {images.shape} {images.dtype}")
    count, _, height, width = images.shape
    scale = max(1, math.ceil(min_cell / width))
    cell_w, cell_h = width * scale, height * scale
    lines = [(captions[i] if i < len(captions) else "").split("\n") for i in range(count)]
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_h = measure.textbbox((0, 0), "Ag")[3] + 3
    caption_h = line_h * max(len(cell) for cell in lines) + 2
    columns = max(1, min(columns, count))
    rows = math.ceil(count / columns)
    grid = Image.new("RGB", (columns * cell_w, rows * (cell_h + caption_h)), "white")
    draw = ImageDraw.Draw(grid)
    for index in range(count):
        tile = Image.fromarray(images[index].transpose(1, 2, 0)).resize((cell_w, cell_h), Image.NEAREST)
        x, y = (index % columns) * cell_w, (index // columns) * (cell_h + caption_h)
        grid.paste(tile, (x, y))
        for number, line in enumerate(lines[index]):
            draw.text((x + 2, y + cell_h + 1 + number * line_h), _fit_line(draw, line, cell_w - 4), fill="black")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def plot_reward_curve(metrics_path: str | Path, out_path: str | Path, key: str = "reward/mean") -> Path | None:
    """Plot `key` per step (and validation reward when present) from metrics.jsonl; None if empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if not points:
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    steps, values = zip(*points)
    axis.plot(steps, values, marker=".", label=f"train {key}")
    val = [(r["step"], r["val/reward_mean"]) for r in records if r.get("val/reward_mean") is not None]
    if val:
        axis.plot(*zip(*val), marker="o", label="validation reward (ODE, fixed seeds)")
    axis.set_xlabel("training step")
    axis.set_ylabel("reward")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out_path)
    plt.close(figure)
    return Path(out_path)
