"""What `flowrl.accel.compile_adapter` does to an adapter, family by family.

Every family: the GELU epilogue in its MLPs (fused_mlp), the LoRA fold in its adapted projections
(lora_fold), every transformer block compiled in place (regional_compile: identical blocks share
one compiled graph, so compile time stays short), and gradient checkpoints taken inside the
compiled blocks. Per family (FAMILIES, keyed by `adapter.family`): where its blocks are, modules
compiled besides the blocks, a fast path installed before compiling, and inductor settings for
no-grad graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import flowrl.accel.flux as flux
import flowrl.accel.qwen_image as qwen_image
from flowrl.accel.fused_mlp import fuse_gelu_epilogues
from flowrl.accel.lora_fold import fold_lora_projections
from flowrl.accel.options import AccelOptions, check_backend
from flowrl.accel.regional_compile import compile_in_place, compiled_settings, take_checkpoints_inside
from flowrl.console import allow_tracing_cached_checks


@dataclass(frozen=True)
class FamilyFastPath:
    """block_lists: the transformer's ModuleLists of blocks, each block compiled in place.
    extra_regions: dotted paths (on the adapter) of modules compiled besides the blocks, without
    kernel tuning (compile_in_place's tune_kernels).
    install(adapter, options): the family's own fast path, installed before compiling.
    no_grad_inductor_options: inductor settings of its no-grad (rollout) graphs, on top of
    regional_compile.INDUCTOR_OPTIONS: a setting that pays on one model's rollout kernels need not
    on another's, nor on the training graphs."""

    block_lists: tuple[str, ...] = ("transformer_blocks",)
    extra_regions: tuple[str, ...] = ()
    install: Callable[[object, AccelOptions], None] | None = None
    no_grad_inductor_options: dict = field(default_factory=dict)


FAMILIES = {
    # The VAE decoder too: GroupNorm + SiLU + convs at full resolution cost about a fifth of a
    # 10-step 512 px rollout in eager mode, and fusing the elementwise work pays there.
    "sd3": FamilyFastPath(extra_regions=("vae.decoder",)),
    "qwen_image": FamilyFastPath(
        install=qwen_image.install, no_grad_inductor_options=qwen_image.NO_GRAD_INDUCTOR_OPTIONS
    ),
    # Double-stream blocks, then single-stream ones (each list shares one compiled graph); the
    # single-stream blocks without their concatenation (flowrl.accel.flux); the same VAE as SD3.
    "flux": FamilyFastPath(
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        extra_regions=("vae.decoder",),
        install=flux.install,
    ),
    # One stream of blocks, in the order the forward runs them: image tokens, text tokens, joint.
    "z_image": FamilyFastPath(block_lists=("noise_refiner", "context_refiner", "layers")),
    # Wan: one list of blocks (A14B's other expert, transformer_2, the one not trained, runs uncompiled).
    "wan2.1": FamilyFastPath(block_lists=("blocks",)),
    "wan2.2": FamilyFastPath(block_lists=("blocks",)),
}


def compiled_regions(adapter) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) pairs that compile_adapter compiles: every transformer block, then the
    family's extra regions."""
    family = FAMILIES.get(adapter.family, FamilyFastPath())
    regions = [
        (f"transformer.{name}.{i}", block)
        for name in family.block_lists
        for i, block in enumerate(getattr(adapter.transformer, name))
    ]
    for path in family.extra_regions:
        module = adapter
        for part in path.split("."):
            module = getattr(module, part)
        regions.append((path, module))
    return regions


def compile_adapter(adapter, backend: str = "inductor", **switches: bool) -> list[str]:
    """flowrl.accel.compile_adapter (see flowrl.accel)."""
    check_backend(backend)
    options = AccelOptions.from_switches(**switches)
    regions = compiled_regions(adapter)
    # Settings fixed by an earlier call are checked before anything changes.
    for _, module in regions:
        compiled_with = compiled_settings(module)
        if compiled_with is not None and compiled_with != backend:
            raise ValueError(
                f"module is compiled already with backend {compiled_with!r}; it cannot be recompiled "
                f"with {backend!r} in this process"
            )
    allow_tracing_cached_checks()  # diffusers' cached version checks trace exactly: no Dynamo warning
    family = FAMILIES.get(adapter.family, FamilyFastPath())
    if family.install is not None:
        family.install(adapter, options)
    fuse_gelu_epilogues(adapter.transformer, options)
    fold_lora_projections(adapter.transformer, options)
    for name, module in regions:
        # Extra regions (the VAE decoder) run once per sample, not once per denoising step: their
        # kernels are not worth timing launch configurations for at compile time.
        tune = name not in family.extra_regions
        compile_in_place(module, backend, family.no_grad_inductor_options, tune_kernels=tune)
    # Gradient checkpointing enabled before this call (as the trainer does) takes its checkpoints
    # inside the compiled blocks; enabled later, diffusers' own wraps them.
    take_checkpoints_inside(adapter.transformer)
    return [name for name, _ in regions]


def is_compiled(adapter) -> bool:
    """flowrl.accel.is_compiled (see flowrl.accel)."""
    return any(compiled_settings(module) is not None for _, module in compiled_regions(adapter))
