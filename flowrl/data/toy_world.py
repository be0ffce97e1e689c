"""The toy world's language: its words, captions as structures, and what each caption requires.

A scene holds 1-4 flat objects (a shape in a colour) on a white background. A caption names one
or two groups of objects, `Group(count, colour, shape)` (colour None: any colour), and for two
single objects optionally a relation between them. Every caption is in one of GenEval's six
categories:

    single_object  "a circle"                    colors      "a red circle"
    two_object     "a circle and a square"       color_attr  "a red circle and a blue square"
    counting       "three blue squares"          position    "a red circle to the left of a blue square"

`parse_caption(text)` reads a caption back into a `Caption` (ValueError naming the caption and the
word at fault), `Caption.text` writes the canonical wording, and `requirements(caption)` lists the
checks an image of it must pass (the evaluator, flowrl.rewards.shapes, scores them): each group is
present; a group of several has exactly its count; the relation holds; and the image holds exactly
the caption's number of objects, nothing else.

It knows words and rules only: no pixels (flowrl.data.toy_render draws scenes) and no split
(flowrl.data.toy_split).
"""

from __future__ import annotations

from dataclasses import dataclass

# name -> RGB. Pairwise at least ~100 apart, and far from the white background, so that the
# evaluator's nearest-colour rule (with a tolerance) survives a VAE's blur.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "orange": (245, 130, 20),
    "yellow": (240, 225, 40),
    "green": (30, 160, 60),
    "blue": (30, 80, 220),
    "purple": (140, 50, 200),
}
BACKGROUND = (255, 255, 255)
SHAPES = ("circle", "square", "triangle")
NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}
RELATIONS = {  # relation key -> its words in a caption
    "left_of": "to the left of",
    "right_of": "to the right of",
    "above": "above",
    "below": "below",
}
MAX_OBJECTS = 4
CATEGORIES = ("single_object", "colors", "two_object", "color_attr", "counting", "position")

_COUNTS = {"a": 1, "an": 1, "one": 1, **{word: count for count, word in NUMBER_WORDS.items()}}
_PLURALS = {shape + "s": shape for shape in SHAPES}


def world_words() -> tuple[str, ...]:
    """Every word a caption may use (the toy model's tokenizers hold each as one token)."""
    words = {"a", "an", "and", *NUMBER_WORDS.values(), *COLOURS, *SHAPES, *_PLURALS}
    for phrase in RELATIONS.values():
        words.update(phrase.split())
    return tuple(sorted(words))


@dataclass(frozen=True)
class Group:
    """`count` objects of `shape`, all of `colour` (None: each of any colour)."""

    count: int
    colour: str | None
    shape: str

    @property
    def phrase(self) -> str:
        """The group's words: "a red circle", "an orange square", "three squares"."""
        noun = self.shape if self.count == 1 else self.shape + "s"
        words = [self.colour, noun] if self.colour else [noun]
        if self.count == 1:
            determiner = "an" if words[0][0] in "aeiou" else "a"
        else:
            determiner = NUMBER_WORDS[self.count]
        return " ".join([determiner, *words])

    def matches(self, colour: str, shape: str) -> bool:
        """Whether an object of `colour` and `shape` belongs to this group."""
        return shape == self.shape and (self.colour is None or colour == self.colour)


@dataclass(frozen=True)
class Caption:
    """One or two groups; `relation` (a RELATIONS key) places groups[0] relative to groups[1]."""

    groups: tuple[Group, ...]
    relation: str | None = None

    @property
    def text(self) -> str:
        if self.relation is not None:
            return f"{self.groups[0].phrase} {RELATIONS[self.relation]} {self.groups[1].phrase}"
        return " and ".join(group.phrase for group in self.groups)

    @property
    def num_objects(self) -> int:
        return sum(group.count for group in self.groups)

    @property
    def category(self) -> str:
        if self.relation is not None:
            return "position"
        coloured = any(group.colour for group in self.groups)
        if len(self.groups) == 2:
            return "color_attr" if coloured else "two_object"
        if self.groups[0].count > 1:
            return "counting"
        return "colors" if coloured else "single_object"

    def pairs(self) -> set[tuple[str, str]]:
        """The (colour, shape) pairs the caption names (groups of any colour left out)."""
        return {(group.colour, group.shape) for group in self.groups if group.colour}


def check_caption(caption: Caption) -> Caption:
    """ValueError when a caption cannot describe a scene of this world; returns it."""
    text = caption.text
    if not 1 <= len(caption.groups) <= 2:
        raise ValueError(f"caption {text!r} names {len(caption.groups)} groups; the toy world has one or two")
    for group in caption.groups:
        if group.shape not in SHAPES or (group.colour is not None and group.colour not in COLOURS):
            raise ValueError(f"caption {text!r}: unknown shape or colour in {group}")
        if not 1 <= group.count <= MAX_OBJECTS:
            raise ValueError(f"caption {text!r}: count {group.count} is outside 1..{MAX_OBJECTS}")
    if caption.num_objects > MAX_OBJECTS:
        raise ValueError(
            f"caption {text!r} asks for {caption.num_objects} objects; a scene holds at most {MAX_OBJECTS}"
        )
    if len(caption.groups) == 2:
        first, second = caption.groups
        if first.shape == second.shape and (
            first.colour is None or second.colour is None or first.colour == second.colour
        ):
            raise ValueError(
                f"caption {text!r}: its two groups could be the same objects; name two different shapes, "
                "or two colours of one shape"
            )
    if caption.relation is not None:
        if caption.relation not in RELATIONS:
            raise ValueError(f"caption {text!r}: unknown relation {caption.relation!r}; use one of {list(RELATIONS)}")
        if len(caption.groups) != 2 or any(group.count != 1 for group in caption.groups):
            raise ValueError(f"caption {text!r}: a relation places one object relative to one other object")
    return caption


def _parse_group(words: list[str], caption: str) -> Group:
    if not words:
        raise ValueError(f"caption {caption!r}: an object is missing (expected e.g. 'a red circle')")
    if words[0] not in _COUNTS:
        raise ValueError(
            f"caption {caption!r}: {words[0]!r} should be 'a', 'an' or a number word ({', '.join(NUMBER_WORDS.values())})"
        )
    count = _COUNTS[words[0]]
    rest = words[1:]
    if len(rest) not in (1, 2):
        raise ValueError(f"caption {caption!r}: {' '.join(words)!r} is not '<a|number> [colour] <shape>'")
    colour = rest[0] if len(rest) == 2 else None
    if colour is not None and colour not in COLOURS:
        raise ValueError(f"caption {caption!r}: unknown colour {colour!r}; the colours are {', '.join(COLOURS)}")
    noun = rest[-1]
    shape = noun if noun in SHAPES else _PLURALS.get(noun)
    if shape is None:
        raise ValueError(
            f"caption {caption!r}: unknown shape {noun!r}; the shapes are {', '.join(SHAPES)} (plural with -s)"
        )
    if (count == 1) != (noun in SHAPES):
        raise ValueError(f"caption {caption!r}: {' '.join(words)!r} mixes singular and plural")
    return Group(count, colour, shape)


def parse_caption(text: str) -> Caption:
    """The Caption a text in the world's grammar describes (case and extra spaces ignored).

    ValueError names the caption and what is wrong with it: an unknown colour or shape, a word
    out of place, an impossible scene."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"caption {text!r} is empty; write e.g. 'a red circle'")
    words = text.lower().replace(",", " ").split()
    joined = " ".join(words)
    for relation, phrase in RELATIONS.items():
        marker = f" {phrase} "
        if marker in f" {joined} ":
            left, _, right = f" {joined} ".partition(marker)
            groups = (_parse_group(left.split(), text), _parse_group(right.split(), text))
            return check_caption(Caption(groups, relation))
    if "and" in words:
        cut = words.index("and")
        groups = (_parse_group(words[:cut], text), _parse_group(words[cut + 1 :], text))
        return check_caption(Caption(groups))
    return check_caption(Caption((_parse_group(words, text),)))


@dataclass(frozen=True)
class Requirement:
    """One check of an image against its caption. kind: "present" (at least one object of
    groups[group]), "count" (exactly its count), "relation", or "total" (exactly
    caption.num_objects objects in the image)."""

    kind: str
    group: int | None
    description: str


def requirements(caption: Caption) -> tuple[Requirement, ...]:
    """The checks an image of `caption` must pass (module docstring), in a fixed order."""
    checks = []
    for index, group in enumerate(caption.groups):
        single = Group(1, group.colour, group.shape).phrase
        checks.append(Requirement("present", index, f"{single} is present"))
        if group.count > 1:
            checks.append(Requirement("count", index, f"exactly {group.phrase}"))
    if caption.relation is not None:
        checks.append(Requirement("relation", None, caption.text))
    total = caption.num_objects
    checks.append(Requirement("total", None, f"exactly {total} object{'s' if total > 1 else ''} in all"))
    return tuple(checks)
