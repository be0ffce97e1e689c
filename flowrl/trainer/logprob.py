"""Re-scoring stored SDE transitions with the current policy.

For the rows of a micro-batch and one trained window step per row, rebuild exactly what the engine
computed: the guided velocity (cond and uncond rows through `adapter.velocity`, from the stored
prompt embeddings) at the stored latent and sigma, then `sampler.sde_step(..., next_latents=)` on
the stored next latent, each row with the settings it was drawn with (its `TransitionSpec`:
noise level, guidance scale, step count and so its schedule's sigma_1). Same function, same
inputs: on CPU float32 the result equals the rollout's log-prob up to batch-shape rounding.

The reference policy (for the KL term) is the same transformer with its LoRA adapter disabled.

Compiled models (`engine.compile`): inductor compiles a block's grad-mode call (the trainer) and
its no-grad call (the rollout, the old-log-prob recompute) into different graphs, which round
bf16 intermediates differently where their fusions differ (and the rollout's graphs fold LoRA
into its base GEMM). With `values_from_no_grad`, a scored micro-batch runs
the no-grad graph first and the grad graph second, and the result takes its VALUES from the first
and only its GRADIENTS from the second (`value + (graded - graded.detach())`, exactly the no-grad
value): the PPO ratio and its clipping then compare the rollout's graph with itself, and the
gradient is that of the same function up to rounding. It costs one no-grad forward per scored
micro-batch. Not with dropout (`takes_values_from_no_grad`). Why it matters: when the rollout's
log-probs are the PPO denominator, with a small clip range (the recipes use 1e-4 and below), the
grad graph's rounding alone can move the ratio out of the clip range before any update; the
no-grad pass's values do not. Where the denominator is
recomputed by the trainer, flowrl.trainer.update scores it with the grad graph instead and needs
no value pass (`Scoring`).

Where each log-prob takes its value from is chosen once, when the updater is built (`Scoring`):
the grad pass itself, or, with a compiled model whose values must agree with the rollout's, the
no-grad graph the rollout ran. The denominator's recompute runs in the same graph as the values it
is compared with. Its gradient always comes from the grad pass.

This module knows the adapter interface and the sampler, nothing about the optimizer or the
rollout engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from flowrl import sampler
from flowrl.config.sections import OldLogProbSource
from flowrl.engine.output import TransitionSpec
from flowrl.models.base import FlowModelAdapter, PromptEncoding, host_to_device, mixed_precision
from flowrl.trainer.velocity import prompt_encodings


def gather_step(tensors: dict[str, torch.Tensor], step_index: torch.Tensor, device):
    """(latents, next_latents, sigma, sigma_next) of window step step_index[row] for each row."""
    rows = torch.arange(step_index.shape[0])
    latents = host_to_device(tensors["all_latents"][rows, step_index], device, torch.float32)
    next_latents = host_to_device(tensors["all_latents"][rows, step_index + 1], device, torch.float32)
    sigma = host_to_device(tensors["sigmas"][rows, step_index], device, torch.float32)
    sigma_next = host_to_device(tensors["next_sigmas"][rows, step_index], device, torch.float32)
    return latents, next_latents, sigma, sigma_next


@dataclass
class _StepInputs:
    """What one scoring pass reads, on the device (built once for both passes of a value pass)."""

    latents: torch.Tensor
    next_latents: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    # The rows' sigmas as host floats, as the engine passes them (FlowModelAdapter.velocity).
    sigma_values: list[float]
    cond: list[PromptEncoding]
    uncond: list[PromptEncoding | None]
    # Per-row settings (B,): what the engine's step used for each row. cfg_scale: the CFG weight
    # (adapter.cfg_scale); guidance: SamplingParams.guidance_scale, for a guidance embedding.
    cfg_scale: torch.Tensor
    guidance: torch.Tensor
    noise_level: torch.Tensor
    sigma_first: torch.Tensor
    # Shared by every row (TransitionSpec.group_key).
    height: int
    width: int
    sde_type: str


def _row_specs(specs: TransitionSpec | Sequence[TransitionSpec], num_rows: int) -> list[TransitionSpec]:
    """One spec per row: `specs` itself, or a single spec repeated for every row."""
    if isinstance(specs, TransitionSpec):
        return [specs] * num_rows
    specs = list(specs)
    assert len(specs) == num_rows, f"{len(specs)} transition specs for {num_rows} rows"
    return specs


def _step_inputs(
    adapter: FlowModelAdapter,
    tensors: dict[str, torch.Tensor],
    step_index: torch.Tensor,
    specs: TransitionSpec | Sequence[TransitionSpec],
) -> _StepInputs:
    device = adapter.device
    specs = _row_specs(specs, step_index.shape[0])
    keys = {spec.group_key for spec in specs}
    if len(keys) > 1:
        raise ValueError(
            f"rows scored together were drawn with different sizes or step types {sorted(keys)}; "
            "score each TransitionSpec.group_key separately"
        )
    sigma_values = tensors["sigmas"][torch.arange(step_index.shape[0]), step_index].tolist()
    latents, next_latents, sigma, sigma_next = gather_step(tensors, step_index, device)
    cond = prompt_encodings(tensors, "", device)
    uncond = [None] * len(cond)
    if "negative_prompt_embeds" in tensors:
        # The engine's rule for an uncond row (adapter.rows_per_sample), row by row, on the
        # stored negative embeddings.
        negative = prompt_encodings(tensors, "negative_", device)
        uncond = [neg if adapter.rows_per_sample(spec) > 1 else None for neg, spec in zip(negative, specs)]
    # sigma_1 of each row's own schedule (cached by the adapter), as the engine's step used it.
    first = [_sigma_first(adapter.sigmas(s.num_inference_steps, s.height, s.width)) for s in specs]
    per_row = host_to_device(
        torch.tensor(
            [
                [adapter.cfg_scale(s) for s in specs],
                [s.guidance_scale for s in specs],
                [s.noise_level for s in specs],
                first,
            ],
            dtype=torch.float32,
        ),
        device,
    )
    cfg_scale, guidance, noise_level, sigma_first = per_row.unbind(0)
    height, width, _, sde_type = keys.pop()
    return _StepInputs(
        latents,
        next_latents,
        sigma,
        sigma_next,
        sigma_values,
        cond,
        uncond,
        cfg_scale,
        guidance,
        noise_level,
        sigma_first,
        height,
        width,
        sde_type,
    )


def _sigma_first(schedule: torch.Tensor) -> float:
    """The sigma the "sde" step uses in place of s = 1 (flowrl.sampler.sde_step): the schedule's
    second one, as the engine's executor takes it."""
    return float(schedule[1] if schedule.shape[0] > 2 else schedule[0])


def takes_values_from_no_grad(adapter: FlowModelAdapter) -> bool:
    """Whether the trainer scores with `values_from_no_grad`: when the model is compiled (module
    docstring), and only when its train-mode forward is deterministic. A dropout layer with p > 0
    (`trainer.lora.dropout`) draws one mask in the value pass and another in the grad pass, so the
    values would not be those of the function whose gradient is taken; such a model keeps the
    grad pass's own values and gradients."""
    from flowrl.accel import is_compiled

    return is_compiled(adapter) and not any(
        isinstance(module, torch.nn.Dropout) and module.p > 0 for module in adapter.transformer.modules()
    )


# Where a grad pass's log-prob values come from: its own graph ("grad_pass"), or a no-grad pass
# of the same forwards run just before it ("value_pass").
ValueSource = Literal["grad_pass", "value_pass"]


@dataclass(frozen=True)
class Scoring:
    """How the update scores: where every grad pass takes its log-prob values from, and whether
    the old-log-prob recompute runs with grad (so that it runs the grad graph those values come
    from) or without."""

    values: ValueSource
    recompute_with_grad: bool = False

    @classmethod
    def choose(cls, adapter: FlowModelAdapter, old_log_prob: OldLogProbSource) -> "Scoring":
        if not takes_values_from_no_grad(adapter):
            # One graph (an eager model, or one with dropout): its own values; the recompute runs
            # the same computation without grad, keeping no activations.
            return cls("grad_pass")
        if old_log_prob == "recompute":
            # Compiled, and the ratio compares the grad graph with itself (the recompute runs it
            # too, with grad, and drops the graph), so no value pass runs at all. The rollout-vs-
            # trainer gap then measures the grad graph. A KL term compares the step's mean with the
            # reference's, a no-grad forward with the LoRA switched off: another graph whichever
            # graph the step's mean comes from, so the value pass would not make the two agree.
            return cls("grad_pass", recompute_with_grad=True)
        # The rollout's log-probs are the denominator: every value comes from the rollout's graph.
        return cls("value_pass")

    @contextlib.contextmanager
    def recompute_mode(self, transformer: torch.nn.Module):
        """The module mode of the graph the recompute runs in: that of the grad passes (train) when
        it runs with grad; eval again afterwards."""
        if self.recompute_with_grad:
            transformer.train()
        try:
            yield
        finally:
            transformer.eval()


def score_transitions(
    adapter: FlowModelAdapter,
    tensors: dict[str, torch.Tensor],
    step_index: torch.Tensor,
    specs: TransitionSpec | Sequence[TransitionSpec],
    autocast_dtype: torch.dtype | None = None,
    values_from_no_grad: bool = False,
) -> sampler.StepResult:
    """Log-prob (B,) of the stored next latents under the current policy, plus the step's mean
    and stds (for the KL). `specs`: the settings each row was drawn with (one TransitionSpec per
    row, or one for all), sharing one `group_key`. Gradients flow when called with grad enabled;
    with `values_from_no_grad` too, the log-prob's and the mean's values come from a no-grad pass
    (module docstring)."""
    inputs = _step_inputs(adapter, tensors, step_index, specs)
    if not (values_from_no_grad and torch.is_grad_enabled()):
        return _score(adapter, inputs, autocast_dtype)
    with torch.no_grad():
        value = _score(adapter, inputs, autocast_dtype)
    return with_values(_score(adapter, inputs, autocast_dtype), value.log_prob, value.mean)


def with_values(
    graded: sampler.StepResult, log_prob: torch.Tensor, mean: torch.Tensor | None = None
) -> sampler.StepResult:
    """`graded` (a grad pass) with the values `log_prob` (and `mean`, when given) and graded's
    gradients: v + (g - g.detach()) is v exactly (g - g is 0)."""
    log_prob = log_prob.to(graded.log_prob.device, graded.log_prob.dtype)
    return sampler.StepResult(
        next_latents=graded.next_latents,
        log_prob=log_prob + (graded.log_prob - graded.log_prob.detach()),
        mean=graded.mean if mean is None else mean + (graded.mean - graded.mean.detach()),
        std=graded.std,
        kl_std=graded.kl_std,
        velocity=graded.velocity,
    )


def _score(adapter: FlowModelAdapter, inputs: _StepInputs, autocast_dtype: torch.dtype | None) -> sampler.StepResult:
    """One pass of score_transitions, with grad if grad is enabled: the guided velocity the
    engine used for these rows (CFG rows in the same forward), then the SDE step's log-prob."""
    device = adapter.device
    with mixed_precision(device, autocast_dtype):
        velocity = adapter.velocity(
            inputs.latents,
            inputs.sigma,
            inputs.cond,
            inputs.uncond,
            inputs.cfg_scale,
            inputs.height,
            inputs.width,
            sigma_values=inputs.sigma_values,
            **adapter.guidance_embedding_kwargs(inputs.guidance),
        )
    return sampler.sde_step(
        inputs.latents,
        velocity.float(),
        inputs.sigma,
        inputs.sigma_next,
        noise_level=inputs.noise_level,
        sde_type=inputs.sde_type,
        next_latents=inputs.next_latents,
        sigma_first_step=inputs.sigma_first,
    )
