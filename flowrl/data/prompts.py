"""Prompt datasets (.txt, .jsonl, .parquet) and the resumable sampler that feeds training steps.

Every row becomes a dict with `raw_prompt` (the prompt text), `negative_prompt`, `ground_truth`,
`data_source` (standard fields, None / "default" when absent) and any other column of the file.
A .txt file has one prompt per line (blank lines skipped).

`PromptSampler` walks the dataset in epochs, shuffled per epoch from (seed, epoch) alone, so its
whole state is two integers (epoch, position) that a checkpoint stores in JSON. This module
knows nothing about models, rollouts or training: rows are plain dicts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# The embedded prompts of the tiny CPU run (data.train_path unset). The tiny model has random
# text encoders, so the prompts only need to differ from each other.
TINY_PROMPTS = (
    "a red apple on a wooden table",
    "a lighthouse on a cliff at dusk",
    "a cat sleeping on a sofa",
    "a bowl of ramen with chopsticks",
    "a snowy mountain under a blue sky",
    "a vintage bicycle by a wall",
    "a field of sunflowers",
    "an astronaut riding a horse",
    "a cup of coffee on a desk",
    "a city street at night in the rain",
    "a sailboat on a calm lake",
    "a robot reading a book",
    "a castle in the clouds",
    "a fox in a snowy forest",
    "a plate of colorful macarons",
    "a hot air balloon over fields",
)

STANDARD_FIELDS = ("negative_prompt", "ground_truth", "data_source")


def _read_txt(path: Path) -> list[dict]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [{"prompt": line} for line in lines if line]


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not valid JSON ({error}); write one JSON object per line") from None
        if not isinstance(row, dict):
            raise ValueError(f'{path}:{number} holds {type(row).__name__}, not a JSON object like {{"prompt": "..."}}')
        rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def load_prompt_rows(
    path: str | Path | None,
    prompt_field: str = "prompt",
    max_prompts: int | None = None,
    field_name: str = "data.train_path",
) -> list[dict]:
    """Rows ready for `RolloutBatch.from_rows` (see the module docstring). path None: the
    embedded tiny prompt list. Raises ValueError for a missing, unreadable or empty dataset."""
    if path is None:
        raw = [{"prompt": p} for p in TINY_PROMPTS]
        prompt_field = "prompt"
    else:
        path = Path(path)
        if path.suffix not in _READERS:
            raise ValueError(f"{field_name}={str(path)!r} has an unsupported suffix; use one of {', '.join(_READERS)}")
        if not path.is_file():
            raise ValueError(f"{field_name}={str(path)!r} does not exist; pass an existing prompt file")
        raw = _READERS[path.suffix](path)
    rows = []
    for index, item in enumerate(raw):
        prompt = item.get(prompt_field)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(
                f"{field_name}={str(path)!r} row {index} has no text in field {prompt_field!r} "
                f"(fields: {sorted(item)}); set data.prompt_field to the column holding the prompt"
            )
        row = {k: v for k, v in item.items() if k != prompt_field}
        row["raw_prompt"] = prompt
        if row.get("data_source") is None:  # parquet gives None for a missing column value
            row["data_source"] = "default"
        for name in ("negative_prompt", "ground_truth"):
            row.setdefault(name, None)
        rows.append(row)
    if max_prompts is not None:
        rows = rows[:max_prompts]
    if not rows:
        raise ValueError(f"{field_name}={str(path)!r} holds no prompts; give a file with at least one prompt")
    return rows


class PromptSampler:
    """Hands out `prompts_per_step` rows per call, epoch after epoch (see the module docstring).

    A step never spans two epochs' shuffles in a surprising way: it takes the rest of the current
    epoch and continues with the next one. `epochs_done` counts completed passes.
    """

    def __init__(self, rows: list[dict], prompts_per_step: int, shuffle: bool = True, seed: int = 0):
        if not rows:
            raise ValueError("PromptSampler needs at least one prompt row")
        if prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step={prompts_per_step} must be >= 1")
        self.rows = rows
        self.prompts_per_step = prompts_per_step
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    @property
    def epochs_done(self) -> int:
        return self.epoch

    def next_rows(self) -> list[dict]:
        picked = []
        while len(picked) < self.prompts_per_step:
            order = self._order(self.epoch)
            take = min(self.prompts_per_step - len(picked), len(order) - self.position)
            picked += [self.rows[i] for i in order[self.position : self.position + take]]
            self.position += take
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return [dict(row) for row in picked]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != len(self.rows):
            raise ValueError(
                f"the checkpoint was written with a dataset of {state['num_rows']} prompts but this one has "
                f"{len(self.rows)}; resume with the same data.train_path / data.max_prompts"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
