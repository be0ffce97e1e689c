"""OCR prompt rows: prompts that ask for a quoted text rendered in a scene, with that text as the
ground truth the OCR reward compares against.

Each row is {"prompt": ..., "ground_truth": ..., "data_source": "ocr"}. The text is 1-3 words
from our own word list (flowrl.data.ocr_words), in UPPER, Title or lower case; the templates are
our own. Same seed, same rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from flowrl.data.ocr_words import OCR_WORDS

DATA_SOURCE = "ocr"

# Each template has exactly one {text} slot, inside double quotes, so the target is unambiguous.
SCENE_TEMPLATES: tuple[str, ...] = (
    'A neon sign above a shop door that reads "{text}"',
    'A wooden signboard in a sunny garden with the words "{text}" painted on it',
    'A chalkboard menu outside a cafe with "{text}" written in white chalk',
    'A vintage poster on a brick wall with the title "{text}" in bold letters',
    'A coffee mug on a desk printed with the text "{text}"',
    'A paper banner hanging between two trees that says "{text}"',
    'A road sign on an empty highway at dusk that reads "{text}"',
    'A book cover lying on a table with the title "{text}"',
    'A T-shirt on a hanger with "{text}" printed across the chest',
    'A birthday cake with "{text}" written in icing',
    'Sand on a beach with the words "{text}" drawn by a finger',
    'A glowing billboard in a rainy city at night showing "{text}"',
    'A handwritten note pinned to a corkboard that says "{text}"',
    'A storefront window with golden letters spelling "{text}"',
    'A movie theater marquee announcing "{text}"',
    'A delivery truck with "{text}" painted on its side',
    'A stone plaque on a museum wall engraved with "{text}"',
    'A laptop screen showing a slide with the big heading "{text}"',
    'A street mural of colorful graffiti letters spelling "{text}"',
    'A label on a glass jar of jam that reads "{text}"',
)


def _random_text(rng: random.Random) -> str:
    words = [rng.choice(OCR_WORDS) for _ in range(rng.choice((1, 1, 2, 2, 3)))]
    text = " ".join(words)
    casing = rng.random()
    if casing < 0.5:
        return text.upper()
    if casing < 0.8:
        return text.title()
    return text


def make_ocr_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """`num_rows` prompt rows, deterministic for a given seed."""
    if not isinstance(num_rows, int) or num_rows < 1:
        raise ValueError(f"num_rows={num_rows!r} must be an integer >= 1")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        text = _random_text(rng)
        template = rng.choice(SCENE_TEMPLATES)
        rows.append({"prompt": template.format(text=text), "ground_truth": text, "data_source": DATA_SOURCE})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
