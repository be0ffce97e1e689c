"""The one list of supported model families: diffusers pipeline class -> family name -> adapter.

`read_model_family(path)` reads a local diffusers folder's model_index.json and names its family;
`check_model_files(path)` checks that the components it lists are there and whole;
`model_has_two_experts(path)` says whether it holds two experts (Wan2.2-A14B);
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
from flowrl.models.debug.random_weights import (
    has_two_random_experts,
    is_random_path,
    load_random_adapter,
    random_family,
)
from flowrl.models.flux import FluxAdapter
from flowrl.models.offload import offload_text_encoders
from flowrl.models.qwen_image import QwenImageAdapter
from flowrl.models.sd3 import SD3Adapter
from flowrl.models.wan import Wan21Adapter, Wan22Adapter, check_trained_expert, has_two_experts, wan_version
from flowrl.models.z_image import ZImageAdapter

# model_index.json's `_class_name` -> (family, adapter class). A pipeline class that several
# families share has one entry per family, "Class (family)", and a VARIANTS rule that picks it.
FAMILIES: dict[str, tuple[str, type[FlowModelAdapter]]] = {
    "StableDiffusion3Pipeline": ("sd3", SD3Adapter),
    "QwenImagePipeline": ("qwen_image", QwenImageAdapter),
    "FluxPipeline": ("flux", FluxAdapter),
    "ZImagePipeline": ("z_image", ZImageAdapter),
    "WanPipeline (wan2.1)": ("wan2.1", Wan21Adapter),
    "WanPipeline (wan2.2)": ("wan2.2", Wan22Adapter),
}
# `_class_name` -> a rule naming the family from the whole model_index.json.
VARIANTS = {"WanPipeline": wan_version}


def pipeline_class_name(entry: str) -> str:
    """The diffusers pipeline class of a FAMILIES key ("WanPipeline (wan2.2)" -> "WanPipeline")."""
    return entry.split(" (")[0]


def read_model_family(path: str | Path, key: str = "model.path") -> str:
    """Return the family name ("sd3", "qwen_image", "flux", "z_image", "wan2.1", "wan2.2") of a local diffusers folder or
    of `random:NAME`; errors name the setting the path came from as `key` (a config key, or a
    command-line flag)."""
    if is_random_path(path):
        return random_family(path, key)
    return _family_entry(path, key)[0]


def load_adapter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, **options
) -> FlowModelAdapter:
    """Load the adapter of the family stored at `path` (a local diffusers folder), or of
    `random:NAME` with random weights (options: the adapter's, and load_random_adapter's).
    `trained_expert` (model.trained_expert) is refused, before anything loads, unless the folder
    holds two experts; only then does it reach the (Wan) adapter."""
    check_trained_expert(options.get("trained_expert"), model_has_two_experts(path), f"the model at {str(path)!r}")
    offload = options.pop("offload_text_encoders", False)
    if offload:
        check_text_encoder_offload(path, device)
    adapter = _load(path, device, dtype, **options)
    if offload:
        offload_text_encoders(adapter)
    return adapter


def check_text_encoder_offload(path, device) -> None:
    """model.offload_text_encoders=true frees GPU memory held by real text encoders: refused, with
    the fix, on a CPU device and for `random:NAME` (random prompt embeddings, no encoder)."""
    if torch.device(device).type == "cpu":
        raise ValueError(
            "model.offload_text_encoders=true keeps the text encoders on the CPU to free GPU memory, but the "
            "model runs on the CPU, where there is none to free; set model.offload_text_encoders=false"
        )
    if is_random_path(path):
        raise ValueError(
            f"model.offload_text_encoders=true, but model.path={str(path)!r} has no text encoders (random prompt "
            "embeddings stand in for them); set model.offload_text_encoders=false"
        )


def _load(path, device, dtype, **options) -> FlowModelAdapter:
    if is_random_path(path):
        family = random_family(path)
        pipeline_class, adapter_class = next((n, cls) for n, (fam, cls) in FAMILIES.items() if fam == family)
        pipeline_class = pipeline_class_name(pipeline_class)
        return load_random_adapter(str(path), pipeline_class, adapter_class, device=device, dtype=dtype, **options)
    _, adapter_class = _family_entry(path)
    return adapter_class.from_pretrained(path, device=device, dtype=dtype, **options)


def model_has_two_experts(path: str | Path) -> bool:
    """Whether the model at `path` has two experts (Wan2.2-T2V-A14B's `transformer_2`, or
    `random:wan2.2-a14b`)."""
    if is_random_path(path):
        return has_two_random_experts(path)
    index = _read_index(Path(path), "model.path")
    return index["_class_name"] == "WanPipeline" and has_two_experts(index)


def _read_index(path: Path, key: str) -> dict:
    """The folder's model_index.json; ValueError naming the file when it is missing or damaged."""
    index = path / "model_index.json"
    if not index.is_file():
        raise ValueError(
            f"{key}={str(path)!r} is not a diffusers checkpoint folder (no model_index.json); "
            "pass the folder written by `save_pretrained`, or build a tiny one with "
            "`flowrl make-tiny --kind sd3 OUT`"
        )
    try:
        content = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{key}={str(path)!r}: {index} is not valid JSON ({error}); restore the file") from None
    if not isinstance(content, dict) or not isinstance(content.get("_class_name"), str):
        raise ValueError(f'{key}={str(path)!r}: {index} names no pipeline (no "_class_name"); restore the file')
    return content


def check_model_files(path: str | Path, key: str = "model.path") -> None:
    """Every component the folder's model_index.json lists is there, and its safetensors files are
    whole (each file's size against its header): a partial download is named, file and fix, before
    diffusers loads anything. `random:NAME` has no files."""
    if is_random_path(path):
        return
    path = Path(path)
    for name, entry in _read_index(path, key).items():
        if name.startswith("_") or not isinstance(entry, list) or None in entry:
            continue  # metadata, or a component the pipeline leaves out ([null, null])
        folder = path / name
        if not folder.is_dir():
            raise ValueError(
                f"{key}={str(path)!r} has no {name}/ folder, which model_index.json lists ({entry[-1]}); "
                "the folder is incomplete: download or copy the whole checkpoint again"
            )
        for file in sorted(folder.glob("*.safetensors")):
            fault = _safetensors_fault(file)
            if fault:
                raise ValueError(
                    f"{key}={str(path)!r}: {name}/{file.name} {fault}; the file is damaged or its download "
                    "stopped early: download or copy it again"
                )


def _safetensors_fault(file: Path) -> str | None:
    """What is wrong with a safetensors file's framing (None: its size is what its header says)."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or size < 8 + length:
            return f"is truncated ({size} bytes, its header cut off)"
        try:
            header = json.loads(handle.read(length))
            end = max((t["data_offsets"][1] for n, t in header.items() if n != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return "has a damaged header (not a safetensors file)"
    if size < 8 + length + end:
        return f"is truncated ({size} bytes; its header describes {8 + length + end})"
    return None


def _family_entry(path: str | Path, key: str = "model.path") -> tuple[str, type[FlowModelAdapter]]:
    path = Path(path)
    index = _read_index(path, key)
    class_name = index["_class_name"]
    if class_name in VARIANTS:
        class_name = f"{class_name} ({VARIANTS[class_name](index)})"
    if class_name not in FAMILIES:
        supported = dict.fromkeys(pipeline_class_name(name) for name in FAMILIES)
        raise ValueError(
            f"{key}={str(path)!r} holds a {class_name}, which flowrl does not support; "
            f"supported pipelines: {', '.join(supported)}"
        )
    return FAMILIES[class_name]
