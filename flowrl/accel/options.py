"""The settings of `flowrl.accel.compile_adapter`: the backend, and one switch per fast path.

Every switch is on by default, which is what the engine and the trainer run; turning one off gives
the eager PyTorch expression (or inductor's own kernels) for that piece, for A/B comparisons.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import get_args

from flowrl.config.sections import CompileBackend

COMPILE_BACKENDS: tuple[str, ...] = get_args(CompileBackend)


@dataclass(frozen=True)
class AccelOptions:
    """Which fast paths a compiled adapter runs (see flowrl.accel's module docstring).

    gelu_epilogue: GELU(tanh) inside the MLP's first GEMM on CUDA (flowrl.accel.fused_mlp), with
        LoRA on that GEMM too where `lora_fold` folds it (flowrl.accel.lora_fold).
    lora_fold: in rollout graphs, each LoRA projection as one op that accumulates the low-rank term
        inside the base GEMM's output (flowrl.accel.lora_fold).
    sequence_major: Qwen-Image blocks on sequence-major activations (flowrl.accel.qwen_image.block);
        False keeps diffusers' batch-major block forward (with real-arithmetic RoPE). Fixed by the
        first compile of an adapter.
    split_output: FLUX single-stream blocks project their attention and MLP branches with the two
        halves of the output projection instead of concatenating them (flowrl.accel.flux).
    """

    gelu_epilogue: bool = True
    lora_fold: bool = True
    sequence_major: bool = True
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
