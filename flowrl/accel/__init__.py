"""flowrl's fast paths: regional torch.compile, fused and hand-written kernels, the LoRA fold and
per-family block fast paths, all behind one entry.

    from flowrl.accel import compile_adapter
    names = compile_adapter(adapter, backend="inductor", rounding="eager")  # every fast path on
    compile_adapter(adapter, "inductor", "eager", norm_kernel=False)        # one switched off (A/B)

`compile_adapter(adapter, backend, rounding, **switches)` compiles an adapter's hot modules in
place (parameters, names, hooks and state_dict stay; the engine and the trainer share them) and
returns their names. `backend` and `rounding` are flowrl.config's `CompileBackend` and
`CompileRounding`; each switch (flowrl.accel.options.AccelOptions, all on by default) turns one
fast path on or off. Called again on the same adapter it keeps the compiled modules and applies
the new switches (graphs that read a changed switch retrace); backend, rounding and
`sequence_major` are fixed by the first call. `is_compiled(adapter)` says whether it ran.
`set_training_cuda_graphs(adapter, True)` replays the compiled blocks' training graphs as CUDA
graphs (the trainer's `trainer.cuda_graphs`); `cuda_graph_skips()` counts graphs inductor could
not graph. `set_training_activation_budget(adapter, budget)` keeps that share of the activations
the training graphs would keep for their backward, recomputing the rest there (the trainer's
`trainer.activation_memory_budget`).

Exactness rule, for every fast path here: results equal the eager path's up to bf16 rounding (in
float32, up to summation order), and each kernel rounds where eager PyTorch rounds wherever it
can; tests/accel/ proves each against the expression it replaces. Where a fast path cannot
reproduce the eager function (grad mode for the rollout-only kernels, autocast for the
modulated-norm kernel, LoRA dropout for the fold, a CPU without Triton) it steps aside and the
eager expression runs.

Layout: options.py (the switches), adapter.py (what compiling an adapter does, per family),
regional_compile.py (torch.compile in place), fused_mlp.py (GELU in the GEMM epilogue),
lora_fold.py (LoRA's low-rank term inside the base GEMM, with an adapted MLP's GELU in its
epilogue), qwen_image/ (Qwen-Image's block fast
path and modulation table), flux.py (FLUX.1's single-stream blocks without their concatenation).
The core (config, sampler, models, engine, rollout, trainer) imports
only the functions below from here, inside the functions that need them, and the
adapters expose one hook that this package installs into (QwenImageAdapter.transformer_call_hook).
Importing this package loads none of torch's compiler.
"""

from __future__ import annotations


def compile_adapter(adapter, backend: str = "inductor", rounding: str = "eager", **switches: bool) -> list[str]:
    """Compile `adapter`'s hot modules in place with flowrl's fast paths (module docstring);
    returns the compiled modules' names. Bad settings are a ValueError naming the choices."""
    from flowrl.accel.adapter import compile_adapter as compile_

    return compile_(adapter, backend, rounding, **switches)


def set_training_cuda_graphs(adapter, enabled: bool) -> None:
    """Replay the compiled blocks' training graphs (forwards with grad and their backwards) as
    CUDA graphs, or not (the default). Rollout graphs are never graphed. A ValueError when the
    adapter is not compiled, or (turning them on) not on a CUDA device or not compiled with
    inductor. Callers keep the contract of regional_compile.set_grad_cuda_graphs: each grad
    forward starts with `torch.compiler.cudagraph_mark_step_begin()` once the previous one's
    backward ran, and gradients accumulate into `.grad` tensors allocated outside the graphs."""
    from flowrl.accel.adapter import set_training_cuda_graphs as set_graphs

    set_graphs(adapter, enabled)


def set_training_activation_budget(adapter, budget: float) -> None:
    """Compile the blocks' training graphs keeping at most `budget` (0 < budget <= 1) of the
    activations their forwards keep for the backward by default, recomputing the rest in the
    backward, elementwise results first (regional_compile.set_grad_activation_budget says how).
    Set before the first training forward. A ValueError when the adapter is not compiled or the
    budget is out of range."""
    from flowrl.accel.adapter import set_training_activation_budget as set_budget

    set_budget(adapter, budget)


def cuda_graph_skips() -> int:
    """How many compiled graphs inductor ran without CUDA graphs although asked to, in this
    process (each logged with its reason, e.g. an input mutated in place): 0 means every graph
    asked for was graphed."""
    from flowrl.accel.adapter import cuda_graph_skips as skips

    return skips()


def is_compiled(adapter) -> bool:
    """Whether `compile_adapter` compiled this adapter's modules."""
    from flowrl.accel.adapter import is_compiled as compiled

    return compiled(adapter)


__all__ = [
    "compile_adapter",
    "cuda_graph_skips",
    "is_compiled",
    "set_training_activation_budget",
    "set_training_cuda_graphs",
]
