"""Regional torch.compile of a model's hot modules, in place: what `flowrl.accel.compile_adapter`
does to each block (the engine's and the trainer's `engine.compile`).

Each module (a transformer block, SD3's VAE decoder) keeps its parameters, names, hooks and
state_dict; only its call goes through compiled graphs: one for calls with grad (the trainer), one
for calls without (the rollout, the old-log-prob recompute), with the batch dim dynamic. Where
inductor rounds low-precision intermediates exactly where eager PyTorch does
(`emulate_precision_casts`, INDUCTOR_OPTIONS). With gradient checkpointing, the checkpoint is taken
inside the compiled grad graph (`checkpoint_inside`).
"""

from __future__ import annotations

import threading

import torch
import torch._inductor.config
import torch.utils.checkpoint

from flowrl.accel.options import check_backend

# Inductor settings of every compiled module. Passed to torch.compile as options, so they hold in
# whichever thread compiles (the engine thread compiles the rollout graph, the trainer's thread
# the grad-mode graph; torch 2.13 keeps config overrides per thread).
INDUCTOR_OPTIONS = {
    # Tune each generated kernel's launch configuration by coordinate descent: a small gain in
    # rollout throughput, paid once at compile time.
    "coordinate_descent_tuning": True,
    # Low-precision intermediates inside fused kernels are rounded exactly where eager rounds them.
    # Otherwise the trainer's grad-mode graph, which inductor fuses differently (it keeps some
    # activations for backward), rounds at other points than the rollout's no-grad graph and
    # log-probs drift (tiny Qwen-Image in bf16 on CPU, rollout vs trainer: a gap without it,
    # exactly 0 with it; tests/trainer/test_logprob_parity.py).
    "emulate_precision_casts": True,
}


def _batch_tensors(args: tuple, kwargs: dict) -> tuple[int, list[torch.Tensor]]:
    """The batch size (dim 0 of the first tensor argument) and the top-level tensor arguments that
    carry it (hidden states, text states, masks, per-row timestep embeddings)."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        return 0, []
    batch = tensors[0].shape[0]
    return batch, [t for t in tensors if t.shape[0] == batch]


def _repeat_rows(value, ids: set[int]):
    return torch.cat([value, value]) if isinstance(value, torch.Tensor) and id(value) in ids else value


def _first_row(value):
    """Row 0 of every tensor in a module output (a tensor, or a tuple/list holding tensors)."""
    if isinstance(value, torch.Tensor):
        return value[:1]
    if isinstance(value, (tuple, list)):
        return type(value)(_first_row(v) for v in value)
    return value


def compile_in_place(
    module: torch.nn.Module,
    backend: str = "inductor",
    no_grad_options: dict | None = None,
    tune_kernels: bool = True,
    options: dict | None = None,
) -> bool:
    """torch.compile `module`'s call in place (what `nn.Module.compile` does), batch dim dynamic.
    Parameter names, state_dict keys, hooks and LoRA injection stay as they were, so the trainer
    and weight sync see the same module. Returns False when it was compiled already.

    Batch sizes: one graph serves every batch >= 2 (dim 0 marked dynamic outside the compiled
    frame, hence the small wrapper; `dynamic=True` would also make token counts and widths
    symbolic, which costs kernel quality). Torch specializes size 1, which would mean a second
    compilation of every block variant; instead a batch of 1 runs as 2 identical rows and keeps
    row 0 (the padding row only costs compute; the real row's result is the same function of its
    inputs, up to batch-shape rounding like any batch).

    no_grad_options: inductor settings, on top of INDUCTOR_OPTIONS, for calls without autograd
    (the rollout, old-log-prob recompute): those calls run a second compiled function with
    them, calls with grad the plain one (a family's settings, e.g. flowrl.accel.qwen_image).
    A module compiled already with other settings is an error, not silently kept.
    tune_kernels: False compiles without INDUCTOR_OPTIONS' coordinate-descent tuning, which times
    candidate launch configurations of every generated kernel: a long compile for a module of many
    distinct large kernels, such as a VAE decoder.
    options: inductor settings on top of all the others, for every compiled call, with and without
    grad (experiments: the block benchmarks' variants).

    Gradient checkpointing: `module._flowrl_checkpointed_call(*args)` runs a grad call with the
    checkpoint inside a third compiled function (see `checkpoint_inside`).
    """
    check_backend(backend)
    compiled_with = compiled_settings(module)
    if compiled_with is not None:
        if compiled_with != backend:
            raise ValueError(
                f"module is compiled already with backend {compiled_with!r}; it cannot be recompiled "
                f"with {backend!r} in this process"
            )
        return False
    extra = options or {}
    options = (
        {
            **INDUCTOR_OPTIONS,
            **({} if tune_kernels else {"coordinate_descent_tuning": False}),
            **extra,
        }
        if backend == "inductor"
        else None
    )
    compiled = torch.compile(module._call_impl, backend=backend, dynamic=None, options=options)
    compiled_no_grad = compiled
    if backend == "inductor" and no_grad_options:
        # A separate torch.compile (dynamo guards entries on their backend, so the two never mix).
        compiled_no_grad = torch.compile(
            module._call_impl, backend=backend, dynamic=None, options={**options, **no_grad_options, **extra}
        )
    # Compiled on its first call only (torch.compile is lazy): runs without checkpointing never pay.
    compiled_checkpointed = torch.compile(
        _checkpointed(module._call_impl), backend=backend, dynamic=None, options=options
    )

    def call_with_dynamic_batch(args: tuple, kwargs: dict, checkpoint: bool):
        _raise_recompile_limit()  # in the calling thread: the engine's, the trainer's
        batch, tensors = _batch_tensors(args, kwargs)
        padded = batch == 1
        if padded:
            ids = {id(t) for t in tensors}
            args = tuple(_repeat_rows(a, ids) for a in args)
            kwargs = {k: _repeat_rows(v, ids) for k, v in kwargs.items()}
            _, tensors = _batch_tensors(args, kwargs)
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        if not torch.is_grad_enabled():
            fn = compiled_no_grad
        else:
            fn = compiled_checkpointed if checkpoint else compiled
        out = fn(*args, **kwargs)
        return _first_row(out) if padded else out

    module._compiled_call_impl = lambda *args, **kwargs: call_with_dynamic_batch(args, kwargs, checkpoint=False)
    module._flowrl_checkpointed_call = lambda *args, **kwargs: call_with_dynamic_batch(args, kwargs, checkpoint=True)
    module._flowrl_compile_settings = backend
    return True


def compiled_settings(module: torch.nn.Module) -> str | None:
    """The backend `compile_in_place` compiled `module` with; None if it did not."""
    return getattr(module, "_flowrl_compile_settings", None)


def _checkpointed(call):
    def run_checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(call, *args, use_reentrant=False, **kwargs)

    return run_checkpointed


def take_checkpoints_inside(model: torch.nn.Module) -> None:
    """Make every part of `model` that has diffusers' gradient checkpointing on use
    `checkpoint_inside` (call after compiling its blocks in place)."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint_inside


def checkpoint_inside(module: torch.nn.Module, *args):
    """diffusers' gradient-checkpointing function (`_gradient_checkpointing_func`) for a model
    whose blocks are compiled in place: a compiled block runs its grad call with the checkpoint
    inside its compiled graph, so the recompute is part of the compiled backward; any other
    module gets diffusers' own non-reentrant checkpoint.

    Why: a checkpoint around a compiled block runs autograd hooks on every tensor the block
    saves and a second trip through dynamo for the recompute, all host work, and a compiled
    training step is bound by the host. Inside, the recompute costs no host work of its own and
    the log-probs are the same."""
    checkpointed_call = getattr(module, "_flowrl_checkpointed_call", None)
    if checkpointed_call is None:
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)
    return checkpointed_call(*args)


def _raise_recompile_limit(minimum: int = 64) -> None:
    # Regional compilation shares one code object (Module._call_impl) across every compiled
    # block; block variants x (batch 1, batch >= 2) x (no-grad, grad) x (LoRA on/off) can pass
    # torch's default limit of 8 graphs, after which blocks silently fall back to eager.
    # torch 2.13 keeps config overrides per thread, so this runs in each calling thread (a
    # thread-local flag keeps the per-call cost at a dict lookup; a config read costs more).
    if getattr(_THREAD_STATE, "recompile_limit", 0) >= minimum:
        return
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < minimum:
        setattr(config, name, minimum)
    _THREAD_STATE.recompile_limit = minimum


_THREAD_STATE = threading.local()
