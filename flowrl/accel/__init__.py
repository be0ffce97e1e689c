"""flowrl's fast paths: regional torch.compile, a fused GELU epilogue, the LoRA fold and per-family
block fast paths, all behind one entry.

    from flowrl.accel import compile_adapter
    names = compile_adapter(adapter, backend="inductor")          # every fast path on
    compile_adapter(adapter, "inductor", gelu_epilogue=False)     # one switched off (A/B)

`compile_adapter(adapter, backend, **switches)` compiles an adapter's hot modules in place
(parameters, names, hooks and state_dict stay; the engine and the trainer share them) and returns
their names. Each switch (flowrl.accel.options.AccelOptions, all on by default) turns one fast path
on or off. Called again on the same adapter it keeps the compiled modules and applies the new
switches (graphs that read a changed switch retrace); the backend and `sequence_major` are fixed by
the first call. `is_compiled(adapter)` says whether it ran.

Exactness rule, for every fast path here: results equal the eager path's up to bf16 rounding (in
float32, up to summation order), and compiled kernels round where eager PyTorch rounds;
tests/accel/ proves each against the expression it replaces. Where a fast path cannot reproduce the
eager function (grad mode for the rollout-only LoRA fold, LoRA dropout) it steps aside and the
eager expression runs. Each fast path is kept because it saved at least 2% of a recipe's rollout
or step on a GPU (benchmarks/results/ holds the measurements).

Layout: options.py (the switches), adapter.py (what compiling an adapter does, per family),
regional_compile.py (torch.compile in place), fused_mlp.py (GELU in the GEMM epilogue),
lora_fold.py (LoRA's low-rank term inside the base GEMM, with an adapted MLP's GELU in its
epilogue), lora_merge.py (training rollouts on the adapter merged into its weights), qwen_image/ (Qwen-Image's real-arithmetic RoPE and sequence-major blocks), flux.py
(FLUX.1's single-stream blocks without their concatenation). The core (config, sampler, models,
engine, rollout, trainer) imports only the functions below from here, inside the functions that
need them. Importing this package loads none of torch's compiler.
"""

from __future__ import annotations


def compile_adapter(adapter, backend: str = "inductor", **switches: bool) -> list[str]:
    """Compile `adapter`'s hot modules in place with flowrl's fast paths (module docstring);
    returns the compiled modules' names. Bad settings are a ValueError naming the choices."""
    from flowrl.accel.adapter import compile_adapter as compile_

    return compile_(adapter, backend, **switches)


def merged_lora(module, seed: int, compiled: bool = False):
    """A context in which every LoRA projection under `module` runs on its merged weight
    W + s B A, stochastically rounded with noise from `seed` (flowrl.accel.lora_merge): the
    rollout fast path of `rollout.merge_lora`."""
    from flowrl.accel.lora_merge import merged_lora as merged

    return merged(module, seed, compiled=compiled)


def is_compiled(adapter) -> bool:
    """Whether `compile_adapter` compiled this adapter's modules."""
    from flowrl.accel.adapter import is_compiled as compiled

    return compiled(adapter)


__all__ = ["compile_adapter", "is_compiled", "merged_lora"]
