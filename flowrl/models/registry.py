"""The one list of supported model families: diffusers pipeline class -> family name -> adapter.

`read_model_family(path)` reads a local diffusers folder's model_index.json and names its family;
`load_adapter(path, ...)` loads that family's adapter. A path `random:NAME` names a published
architecture with random weights instead (flowrl.models.debug.random_weights). Adding a family means
one adapter module and one entry in FAMILIES. (The config's `model.family` choices, flowrl.config,
repeat these names; tests/models/test_adapters.py checks that the two lists agree.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flowrl.models.base import FlowModelAdapter
from flowrl.models.debug.random_weights import is_random_path, load_random_adapter, random_family
from flowrl.models.flux import FluxAdapter
from flowrl.models.qwen_image import QwenImageAdapter
from flowrl.models.sd3 import SD3Adapter
from flowrl.models.z_image import ZImageAdapter

# model_index.json's `_class_name` -> (family, adapter class)
FAMILIES: dict[str, tuple[str, type[FlowModelAdapter]]] = {
    "StableDiffusion3Pipeline": ("sd3", SD3Adapter),
    "QwenImagePipeline": ("qwen_image", QwenImageAdapter),
    "FluxPipeline": ("flux", FluxAdapter),
    "ZImagePipeline": ("z_image", ZImageAdapter),
}


def read_model_family(path: str | Path, key: str = "model.path") -> str:
    """Return the family name ("sd3", "qwen_image", "flux", "z_image") of a local diffusers folder or
    of `random:NAME`; errors name the setting the path came from as `key` (a config key, or a
    command-line flag)."""
    if is_random_path(path):
        return random_family(path, key)
    return _family_entry(path, key)[0]


def load_adapter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, **options
) -> FlowModelAdapter:
    """Load the adapter of the family stored at `path` (a local diffusers folder), or of
    `random:NAME` with random weights (options: the adapter's, and load_random_adapter's)."""
    if is_random_path(path):
        family = random_family(path)
        pipeline_class, adapter_class = next((n, cls) for n, (fam, cls) in FAMILIES.items() if fam == family)
        return load_random_adapter(str(path), pipeline_class, adapter_class, device=device, dtype=dtype, **options)
    _, adapter_class = _family_entry(path)
    return adapter_class.from_pretrained(path, device=device, dtype=dtype, **options)


def _family_entry(path: str | Path, key: str = "model.path") -> tuple[str, type[FlowModelAdapter]]:
    path = Path(path)
    index = path / "model_index.json"
    if not index.is_file():
        raise ValueError(
            f"{key}={str(path)!r} is not a diffusers checkpoint folder (no model_index.json); "
            "pass the folder written by `save_pretrained`, or build a tiny one with "
            "`flowrl make-tiny --kind sd3 OUT`"
        )
    class_name = json.loads(index.read_text())["_class_name"]
    if class_name not in FAMILIES:
        raise ValueError(
            f"{key}={str(path)!r} holds a {class_name}, which flowrl does not support; "
            f"supported pipelines: {', '.join(FAMILIES)}"
        )
    return FAMILIES[class_name]
