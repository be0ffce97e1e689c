"""Training rollouts on merged LoRA weights (`rollout.merge_lora`).

An adapted projection costs a rollout more than its low-rank FLOPs: besides the base GEMM it runs
the small x A^T and (x A^T)(s B)^T GEMMs and adds their result, on every projection of every
block at every denoising step. With the adapter merged, W' = W + s B A, each adapted projection is
one GEMM again and the compiled rollout runs the fast paths of a plain Linear. The weights only
change between rollouts, so the merge is made once when a training rollout begins and dropped
when it ends (`merged_lora`): the trainer's own forwards (recompute, update, validation) always
run the adapter itself (flowrl.trainer.lora.merged_weight), and the merged copy costs device
memory only while the rollout runs: one more copy of every adapted base weight.

W' is kept in the base weight's dtype. Rounded to nearest, a bf16 W' would drop every entry of
s B A under half a unit in the last place of its W entry, which early in training (B starts at
zero, then grows by about the learning rate per step) is nearly all of them: the rollout would
sample the base model. W' is rounded stochastically instead: each entry goes to the
representable value just below or just above W + s B A with the probabilities that make its
expectation exact, so the adapter's change survives on average, with noise of under one unit in
the last place per entry. The rollout thus samples a policy within that noise of the trained one:
`merged_lora` therefore needs algorithm.old_log_prob=recompute (the config refuses it otherwise),
so that both sides of the PPO ratio come from the trainer's forward, and the rollout-vs-trainer
log-prob gap (actor/logprob_gap_*) shows what the merge changes.

The rounding draws from a generator seeded with the seed it is given (the trainer derives it from
rollout.seed and the policy version): every rank of a run merges the same weights, and a resumed
run merges what the straight run did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from flowrl.trainer.lora import MERGED_WEIGHT, adapter_delta


def stochastic_round(values: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """float32 `values` in `dtype`: each entry the nearest representable value below or above it,
    the upper one with probability (value - lower) / (upper - lower), so the expectation is the
    value itself (values `dtype` holds exactly stay as they are). float32 and wider: a plain cast."""
    if dtype.itemsize >= 4:
        return values.to(dtype)
    if dtype == torch.bfloat16:
        # bf16 is float32 without its low 16 bits: adding uniform noise below that bit, then
        # cutting the bits off, rounds the magnitude up with the probability the module wants.
        noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, device=values.device, generator=generator)
        bits = values.contiguous().view(torch.int32) + noise
        return bits.bitwise_and_(-(1 << 16)).view(torch.float32).to(torch.bfloat16)
    nearest = values.to(dtype)
    error = values - nearest.float()
    away = torch.nextafter(nearest, torch.where(error > 0, torch.inf, -torch.inf).to(dtype))
    gap = (away.float() - nearest.float()).abs()
    take_away = torch.rand(values.shape, device=values.device, generator=generator) * gap < error.abs()
    return torch.where(take_away, away, nearest)


def mergeable_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The LoRA Linears under `module` on the trainer's forward (flowrl.trainer.lora) whose active
    adapters are plain low-rank terms over a Linear: those a merged weight stands for."""
    return [
        layer
        for layer in module.modules()
        if getattr(layer, "_flowrl_lora_forward", False)
        and isinstance(layer.base_layer, torch.nn.Linear)
        and not (layer.disable_adapters or layer.merged or layer.lora_variant)
    ]


def merged_weight_of(layer: torch.nn.Module, generator: torch.Generator) -> torch.Tensor:
    """W + s B A of one LoRA Linear, stochastically rounded to W's dtype."""
    weight = layer.base_layer.weight
    return stochastic_round(adapter_delta(layer).add_(weight), weight.dtype, generator)


@contextlib.contextmanager
def merged_lora(module: torch.nn.Module, seed: int) -> Iterator[int]:
    """Inside the block, every forward without grad of `module` computes its mergeable LoRA
    Linears with merged weights (module docstring); yields how many. The merged weights are
    dropped on the way out, whatever ends the block."""
    layers = mergeable_layers(module)
    generators: dict[torch.device, torch.Generator] = {}
    try:
        with torch.no_grad():
            for layer in layers:
                device = layer.base_layer.weight.device
                if device not in generators:
                    generators[device] = torch.Generator(device=device).manual_seed(seed)
                setattr(layer, MERGED_WEIGHT, merged_weight_of(layer, generators[device]))
        yield len(layers)
    finally:
        for layer in layers:
            if hasattr(layer, MERGED_WEIGHT):
                delattr(layer, MERGED_WEIGHT)
