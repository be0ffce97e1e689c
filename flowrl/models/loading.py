"""Loading a diffusers pipeline folder with one flowrl progress bar over its components.

`load_pipeline(pipeline_class, path, dtype)` equals `pipeline_class.from_pretrained(path,
dtype=dtype)`: it loads each component that model_index.json names from diffusers or transformers
with that class's own `from_pretrained(path, subfolder=name)` (torch modules in `dtype`), then hands
them to the pipeline's `from_pretrained`, which loads whatever is left itself. The libraries' own
nested bars are off meanwhile (flowrl.console); the one bar shows which component is loading,
so a long load (a multi-GB text encoder) is not a silent wait.

It knows model_index.json's layout, nothing about any family.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from flowrl.console import library_bars_off, progress_bar

_LIBRARIES = ("diffusers", "transformers")


def pipeline_components(path: str | Path) -> dict[str, tuple[str, str]]:
    """{component name: (library, class name)} of the components flowrl loads itself."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    return {
        name: (spec[0], spec[1])
        for name, spec in index.items()
        if not name.startswith("_") and isinstance(spec, list) and len(spec) == 2 and spec[0] in _LIBRARIES
    }


def load_pipeline(pipeline_class, path: str | Path, dtype: torch.dtype):
    """`pipeline_class.from_pretrained(path, dtype=dtype)` with a flowrl bar (see the module docstring)."""
    path = Path(path)
    components = pipeline_components(path)
    loaded = {}
    with library_bars_off(), progress_bar(total=len(components), desc="loading model", unit="part") as bar:
        for name, (library, class_name) in components.items():
            bar.set_postfix_str(name)
            component_class = getattr(importlib.import_module(library), class_name)
            kwargs = {"dtype": dtype} if issubclass(component_class, torch.nn.Module) else {}
            loaded[name] = component_class.from_pretrained(str(path), subfolder=name, **kwargs)
            bar.update(1)
        bar.set_postfix_str("")
        return pipeline_class.from_pretrained(str(path), dtype=dtype, **loaded)
