"""The toy world's fixed split: what pretraining sees, and the prompts RL trains and is judged on.

Every caption of the six categories is enumerated (`all_captions`). A caption is *novel*, never
shown in pretraining, when it names one of `HELD_OUT_PAIRS` (colour-shape pairs never drawn in
pretraining, not even for a caption of any colour) or when it falls in a seeded share
(`NOVEL_COMPOSITION_SHARE`) of the other counting, two-object and position captions (compositions
of familiar pairs that pretraining never captions). Pretraining draws from the rest. The novel
captions are split, seeded, into the held-out evaluation prompts (`VAL_QUOTAS` per category, half
naming a held-out pair where the category has them, plus `VAL_EXTRA`) and the RL training prompts (all the other
novel ones): the two sets are disjoint, and both ask the model for things it has to compose.

The autoencoder is a codec, not a generator: it is trained on scenes of every caption and every
pair (`codec_examples`), since it must be able to show whatever RL asks the transformer for; only
the transformer's pretraining (`pretraining_examples`) is kept away from the novel captions.

`prompt_rows(split)` gives a split's rows as the prompt files hold them:
{"prompt", "ground_truth" (the same caption, which the shapes reward reads), "data_source": "toy",
"category"}. Validation rows are interleaved by category, so any prefix is balanced.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from itertools import permutations

import numpy as np

from flowrl.data.toy_render import IMAGE_SIZE, render_caption
from flowrl.data.toy_world import CATEGORIES, COLOURS, NUMBER_WORDS, RELATIONS, SHAPES, Caption, Group

SPLIT_SEED = 0
HELD_OUT_PAIRS = frozenset({("orange", "circle"), ("purple", "square"), ("green", "triangle"), ("blue", "circle")})
NOVEL_COMPOSITION_SHARE = 0.2
# Held-out evaluation prompts per category (the novel single-object-with-colour captions are
# exactly the held-out pairs), drawn as the split is made; then VAL_EXTRA more per category, drawn
# from the novel captions left (a second seeded draw, so the first draw, and with it pretraining,
# stays as the committed model saw it). 192 in all, so that the held-out interval is narrow enough to
# tell runs apart (docs/learning.md).
VAL_QUOTAS = {"colors": 4, "counting": 12, "color_attr": 24, "position": 24}
VAL_EXTRA = {"color_attr": 40, "position": 88}
# How often pretraining draws each category.
PRETRAIN_WEIGHTS = {
    "single_object": 0.08,
    "colors": 0.17,
    "two_object": 0.08,
    "color_attr": 0.2,
    "counting": 0.2,
    "position": 0.27,
}
DATA_SOURCE = "toy"
SPLITS = ("train", "val", "pretrain")


def all_captions() -> dict[str, list[Caption]]:
    """Every caption of the world, by category, in a fixed order."""
    singles = [Group(1, colour, shape) for shape in SHAPES for colour in COLOURS]
    plain = [Group(1, None, shape) for shape in SHAPES]
    counted = [Group(n, colour, shape) for n in NUMBER_WORDS for shape in SHAPES for colour in (None, *COLOURS)]
    return {
        "single_object": [Caption((group,)) for group in plain],
        "colors": [Caption((group,)) for group in singles],
        "two_object": [Caption(pair) for pair in permutations(plain, 2)],
        "color_attr": [Caption(pair) for pair in permutations(singles, 2)],
        "counting": [Caption((group,)) for group in counted],
        "position": [
            Caption(pair, relation)
            for relation in RELATIONS
            for pair in [*permutations(plain, 2), *permutations(singles, 2)]
        ],
    }


def names_held_out_pair(caption: Caption) -> bool:
    return bool(caption.pairs() & HELD_OUT_PAIRS)


@functools.lru_cache(maxsize=1)
def split_captions() -> dict[str, tuple[Caption, ...]]:
    """{"pretrain", "train", "val"}: disjoint caption sets (module docstring); fixed by SPLIT_SEED."""
    rng = random.Random(SPLIT_SEED)
    pretrain, train, val = [], [], []
    for category in CATEGORIES:
        captions = all_captions()[category]
        composed = category in ("two_object", "color_attr", "counting", "position")
        held_out = [c for c in captions if names_held_out_pair(c)]
        familiar = [c for c in captions if not names_held_out_pair(c)]
        novel_familiar = [c for c in familiar if composed and rng.random() < NOVEL_COMPOSITION_SHARE]
        novel = set(novel_familiar)
        pretrain += [c for c in familiar if c not in novel]
        quota = VAL_QUOTAS.get(category, 0)
        from_held_out = min(len(held_out), quota if not novel_familiar else quota // 2)
        picked = rng.sample(held_out, from_held_out) + rng.sample(novel_familiar, quota - from_held_out)
        val += picked
        in_val = set(picked)
        train += [c for c in held_out + novel_familiar if c not in in_val]
    extra_rng = random.Random(SPLIT_SEED + 1)
    for category, count in VAL_EXTRA.items():
        moved = extra_rng.sample([c for c in train if c.category == category], count)
        val += moved
        train = [c for c in train if c not in set(moved)]
    return {"pretrain": tuple(pretrain), "train": tuple(train), "val": _interleave_categories(val)}


def _interleave_categories(captions: list[Caption]) -> tuple[Caption, ...]:
    """Round-robin over the categories, so any prefix holds each category in proportion."""
    by_category = {category: [c for c in captions if c.category == category] for category in CATEGORIES}
    order = sorted(
        captions,
        key=lambda c: (by_category[c.category].index(c) / len(by_category[c.category]), CATEGORIES.index(c.category)),
    )
    return tuple(order)


def pretraining_pairs() -> frozenset[tuple[str, str]]:
    """The colour-shape pairs pretraining may draw."""
    return frozenset((colour, shape) for colour in COLOURS for shape in SHAPES) - HELD_OUT_PAIRS


def caption_row(caption: Caption) -> dict:
    return {
        "prompt": caption.text,
        "ground_truth": caption.text,
        "data_source": DATA_SOURCE,
        "category": caption.category,
    }


def prompt_rows(split: str, num: int | None = None, seed: int = 0) -> list[dict]:
    """The rows of `split` ("train", "val": all of them, or the first `num`; "pretrain": `num`
    captions drawn with `seed` as pretraining draws them)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    if split == "pretrain":
        if num is None:
            raise ValueError("the pretrain split is drawn at random: give the number of rows (--num)")
        rng = random.Random(seed)
        return [caption_row(sample_pretraining_caption(rng)) for _ in range(num)]
    captions = split_captions()[split]
    if num is not None and num < 1:
        raise ValueError(f"num={num} must be >= 1")
    return [caption_row(caption) for caption in captions[:num]]


@functools.lru_cache(maxsize=1)
def _pretraining_by_category() -> dict[str, tuple[Caption, ...]]:
    pool = split_captions()["pretrain"]
    return {category: tuple(c for c in pool if c.category == category) for category in CATEGORIES}


def sample_pretraining_caption(rng: random.Random) -> Caption:
    """A pretraining caption: a category by PRETRAIN_WEIGHTS, then a caption of it, uniformly."""
    category = rng.choices(list(PRETRAIN_WEIGHTS), weights=list(PRETRAIN_WEIGHTS.values()))[0]
    return rng.choice(_pretraining_by_category()[category])


def pretraining_examples(num: int, seed: int, image_size: int = IMAGE_SIZE) -> Iterator[tuple[str, np.ndarray]]:
    """`num` (caption text, (H, W, 3) uint8 picture) pairs of the pretraining split, the same for
    the same seed."""
    rng = random.Random(seed)
    allowed = pretraining_pairs()
    for _ in range(num):
        caption = sample_pretraining_caption(rng)
        yield caption.text, render_caption(caption, rng.getrandbits(32), image_size, allowed)


def codec_examples(num: int, seed: int, image_size: int = IMAGE_SIZE) -> Iterator[np.ndarray]:
    """`num` pictures of any caption of the world, every colour-shape pair allowed (the
    autoencoder's data, module docstring), the same for the same seed."""
    rng = random.Random(seed)
    captions = all_captions()
    for _ in range(num):
        category = rng.choices(list(PRETRAIN_WEIGHTS), weights=list(PRETRAIN_WEIGHTS.values()))[0]
        yield render_caption(rng.choice(captions[category]), rng.getrandbits(32), image_size)
