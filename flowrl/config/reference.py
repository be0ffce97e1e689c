"""The configuration reference, read from the config's own field docstrings.

Each field of the sections (flowrl.config.sections) and of SamplingParams is documented by the
docstring written under it. `field_docs(cls)` reads them from the class's source with the standard
library's parser (nothing is imported or run), `section_table(name)` renders one section as a
markdown table (key, default, meaning), and `render(text)` replaces every generated block of a
page, between `<!-- generated: config.SECTION -->` and `<!-- end generated -->`, with the current
table. docs/config.md is written that way (`flowrl config docs --write docs/config.md`), and a test
holds it equal to `render` of itself, so a field's documentation has one home: the field.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
from functools import cache

from flowrl.config.sections import REMOVED_KEYS, FlowRLConfig, field_types
from flowrl.sampling_params import SamplingParams

BLOCK = re.compile(r"(<!-- generated: config\.([\w.]+) -->\n).*?(<!-- end generated -->)", re.S)


@cache
def field_docs(cls) -> dict[str, str]:
    """Field name -> its docstring (one paragraph, whitespace collapsed), for a dataclass whose
    fields are documented by a string literal right under each annotated assignment."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _section_class(path: str):
    """The dataclass at a dotted section path of the root (e.g. "trainer.lora")."""
    cls = FlowRLConfig
    for part in path.split("."):
        cls = field_types(cls)[part]
    return cls


def _default(cls, name: str):
    instance = cls()
    value = getattr(instance, name)
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _shown(value) -> str:
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, dict) and len(json.dumps(value)) > 40:
        return "see below"
    return f"`{json.dumps(value)}`"


def section_table(path: str) -> str:
    """The markdown table of section `path` (e.g. "rollout", "trainer.lora", "rollout.sampling"):
    one row per field that is not itself a section, in declaration order."""
    cls = _section_class(path)
    docs = field_docs(cls)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name not in docs:
            raise ValueError(f"{cls.__name__}.{field.name} has no docstring under it; document the field there")
        meaning = docs[field.name].replace("|", "\\|")
        rows.append(f"| `{field.name}` | {_shown(_default(cls, field.name))} | {meaning} |")
    return "\n".join(rows) + "\n"


def removed_table() -> str:
    """The keys flowrl removed (REMOVED_KEYS) and why, as a markdown table."""
    rows = ["| removed key | why |", "|---|---|"]
    rows += [f"| `{key}` | {why} |" for key, why in REMOVED_KEYS.items()]
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """`text` with every generated block rewritten from the current field docstrings (the block
    `config.removed`: from REMOVED_KEYS)."""

    def table(match) -> str:
        name = match.group(2)
        return match.group(1) + (removed_table() if name == "removed" else section_table(name)) + match.group(3)

    return BLOCK.sub(table, text)


def documented_sections() -> list[str]:
    """Every section path that has fields of its own (the root's sections, their nested ones, and
    the two SamplingParams of the rollout)."""
    paths = []

    def walk(cls, prefix: str) -> None:
        for name, tp in field_types(cls).items():
            if dataclasses.is_dataclass(tp):
                paths.append(f"{prefix}{name}")
                walk(tp, f"{prefix}{name}.")

    walk(FlowRLConfig, "")
    return [p for p in paths if _section_class(p) is not SamplingParams or p == "rollout.sampling"]
