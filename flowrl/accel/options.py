"""The settings of `flowrl.accel.compile_adapter`: backend, rounding, and one switch per fast path.

The backend and rounding choices have their home in flowrl.config (`CompileBackend`,
`CompileRounding`, the engine config's field types); this module reads them from there. Every
switch is on by default, which is what the engine and the trainer run; turning one off gives the
eager PyTorch expression (or inductor's own kernels) for that piece, for A/B comparisons.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import get_args

from flowrl.config.sections import CompileBackend, CompileRounding

COMPILE_BACKENDS: tuple[str, ...] = get_args(CompileBackend)
COMPILE_ROUNDINGS: tuple[str, ...] = get_args(CompileRounding)


@dataclass(frozen=True)
class AccelOptions:
    """Which fast paths a compiled adapter runs (see flowrl.accel's module docstring).

    gelu_epilogue: GELU(tanh) inside the MLP's first GEMM on CUDA (flowrl.accel.fused_mlp), with
        LoRA on that GEMM too where `lora_fold` folds it (flowrl.accel.lora_fold).
    lora_fold: in rollout graphs, each LoRA projection as one op that accumulates the low-rank term
        inside the base GEMM's output (flowrl.accel.lora_fold).
    lora_low_rank_first: the folded op's GEMM order: the low-rank GEMM with the bias writes the
        output and the base GEMM accumulates into it (True), or the other way round.
    sequence_major: Qwen-Image blocks on sequence-major activations (flowrl.accel.qwen_image.block);
        False keeps diffusers' batch-major block forward (with real-arithmetic RoPE). Fixed by the
        first compile of an adapter.
    qk_kernel: Qwen-Image rollout graphs build the joint q and k with the hand-written kernel
        (flowrl.accel.qwen_image.qk_norm_rope); False also turns off `joint_v`.
    joint_v: Qwen-Image rollout graphs write the text and image v projections into one joint
        buffer (flowrl.accel.qwen_image.joint_linear).
    norm_kernel: Qwen-Image rollout graphs run LayerNorm + modulation and gate + residual in the
        hand-written kernel (flowrl.accel.qwen_image.modulated_norm).
    modulation_table: Qwen-Image rollout forwards read each block's modulation from a
        per-timestep table (flowrl.accel.qwen_image.modulation).
    prefix_attention: Qwen-Image batches whose rows' text lengths differ run their joint
        attention as one unmasked call per run of rows with equal lengths, rollout and training
        (flowrl.accel.qwen_image.prefix_attention), instead of one masked call.
    split_output: FLUX single-stream blocks project their attention and MLP branches with the two
        halves of the output projection instead of concatenating them (flowrl.accel.flux).
    """

    gelu_epilogue: bool = True
    lora_fold: bool = True
    lora_low_rank_first: bool = True
    sequence_major: bool = True
    qk_kernel: bool = True
    joint_v: bool = True
    norm_kernel: bool = True
    modulation_table: bool = True
    prefix_attention: bool = True
    split_output: bool = True

    @classmethod
    def from_switches(cls, **switches) -> "AccelOptions":
        """Options from keyword switches; an unknown name or a non-bool value is a ValueError."""
        names = [f.name for f in dataclasses.fields(cls)]
        for name, value in switches.items():
            if name not in names:
                raise ValueError(
                    f"compile_adapter: unknown switch {name}={value!r}; the switches are {', '.join(names)}"
                )
            if not isinstance(value, bool):
                raise ValueError(f"compile_adapter: switch {name}={value!r} must be True or False")
        return cls(**switches)


def check_backend(backend: str) -> str:
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend={backend!r} is unknown; use one of {COMPILE_BACKENDS}")
    return backend


def check_compile_rounding(rounding: str, field: str = "compile_rounding") -> str:
    if rounding not in COMPILE_ROUNDINGS:
        raise ValueError(
            f"{field}={rounding!r} is unknown; use one of {COMPILE_ROUNDINGS} "
            "(eager: rounding where eager PyTorch rounds, the default; fused: only where kernels write)"
        )
    return rounding
