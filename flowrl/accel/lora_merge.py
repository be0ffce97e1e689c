"""Training rollouts on merged LoRA weights (`rollout.merge_lora`).

An adapted projection costs a rollout more than its low-rank FLOPs: besides the base GEMM it runs
the small x A^T and (x A^T)(s B)^T GEMMs and adds their result, on every projection of every
block at every denoising step. With the adapter merged, W' = W + s B A, each adapted projection is
one GEMM again and the compiled rollout runs the fast paths of a plain Linear. The weights only
change between rollouts, so the merge is made once when a training rollout begins and dropped
when it ends (`merged_lora`): the trainer's own forwards (recompute, update, validation) always
run the adapter itself (flowrl.models.lora.merged_weight), and the merged copy costs device
memory only while the rollout runs: one more copy of every adapted base weight. A device without
that much free memory is an error naming rollout.merge_lora and its fix before anything is
allocated (`check_merge_fits`), not an out-of-memory error halfway through the merge: a large
model's copy need not fit beside it and its text encoder (docs/training.md).

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

The rounding's noise is a function of the seed it is given (the trainer derives it from
rollout.seed and the policy version): every rank of a run merges the same weights, and a resumed
run merges what the straight run did. With `compiled=True` (the trainer passes engine.compile),
bfloat16 weights round in one compiled kernel per layer, whose noise is a hash of the entry's index
and the layer's keys (`hashed_noise`): one pass that reads the float32 s B A and W and writes W'.
Otherwise the noise is drawn from a seeded generator into memory first, which takes several passes
over every adapted weight; the hash computed eagerly would take many more, one pass per integer
operation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import numpy as np
import torch

from flowrl.models.lora import MERGED_WEIGHT, adapter_delta

NOISE_BITS = 16  # the rounding's noise: integers uniform in [0, 2^16), one per entry

# A 32-bit integer hash: xor-shift, multiply, twice, then one more xor-shift (shifts and constants
# from Chris Wellons' hash-prospector search), in int32 arithmetic: products wrap modulo 2^32 as
# the hash's unsigned arithmetic does, and each right shift is masked to a logical one. int32 keeps
# the compiled kernel at one 32-bit multiply per product, where int64 products cost several.
_HASH_ROUNDS = ((16, 0x21F0AAAD), (15, 0x735A2D97))
_HASH_FINAL_SHIFT = 15


def _logical_right_shift(x: torch.Tensor, shift: int) -> torch.Tensor:
    # int32's >> copies the sign bit; the hash shifts zeros in.
    return (x >> shift) & ((1 << (32 - shift)) - 1)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    for shift, multiplier in _HASH_ROUNDS:
        x = (x ^ _logical_right_shift(x, shift)) * multiplier
    return x ^ _logical_right_shift(x, _HASH_FINAL_SHIFT)


def rounding_keys(seed: int, layer_number: int) -> torch.Tensor:
    """The two 32-bit keys (an int32 tensor) of one layer's hashed noise under a merge seed:
    distinct layers draw unrelated noise."""
    state = np.random.SeedSequence([seed, layer_number]).generate_state(2)  # uint32
    return torch.from_numpy(state.view(np.int32).copy())


def fits_hashed_noise(numel: int) -> bool:
    """Whether a weight of `numel` entries can round on `hashed_noise` (its indices are int32)."""
    return numel <= torch.iinfo(torch.int32).max


def hashed_noise(numel: int, keys: torch.Tensor) -> torch.Tensor:
    """Rounding noise for indices 0..numel-1 (int32, uniform in [0, 2^NOISE_BITS)): the hash of
    each index mixed with the first key, hashed again with the second (`rounding_keys`)."""
    if not fits_hashed_noise(numel):
        raise ValueError(f"hashed_noise: {numel} entries do not fit int32 indices; round this weight with drawn_noise")
    index = torch.arange(numel, dtype=torch.int32, device=keys.device)
    return _hash32(_hash32(index ^ keys[0]) ^ keys[1]) & ((1 << NOISE_BITS) - 1)


def drawn_noise(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Rounding noise drawn from `generator` (int32, uniform in [0, 2^NOISE_BITS))."""
    return torch.randint(0, 1 << NOISE_BITS, shape, dtype=torch.int32, device=generator.device, generator=generator)


def stochastic_round(values: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """float32 `values` in `dtype`: each entry the nearest representable value below or above it,
    the upper one with probability (value - lower) / (upper - lower), so the expectation is the
    value itself (values `dtype` holds exactly stay as they are). `noise`: one integer uniform in
    [0, 2^NOISE_BITS) per entry, which resolves that probability exactly for bfloat16 (float32
    carries 16 bits below its last) and for normal float16 values (13 or 14 bits); float16's
    subnormals to 2^-16. float32 and wider: a plain cast."""
    if dtype.itemsize >= 4:
        return values.to(dtype)
    noise = noise.to(torch.int32)
    if dtype == torch.bfloat16:
        # bf16 is float32 without its low 16 bits: adding uniform noise below that bit, then
        # cutting the bits off, rounds the magnitude up with the probability the module wants.
        rounded = (values.contiguous().view(torch.int32) + noise) & -(1 << 16)
        return rounded.view(torch.float32).to(torch.bfloat16)
    nearest = values.to(dtype)
    error = values - nearest.float()
    away = torch.nextafter(nearest, torch.where(error > 0, torch.inf, -torch.inf).to(dtype))
    gap = (away.float() - nearest.float()).abs()
    uniform = noise.to(torch.float32) * 2.0**-NOISE_BITS  # in [0, 1)
    return torch.where(uniform * gap < error.abs(), away, nearest)


def round_merge_hashed(delta: torch.Tensor, weight: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Flat W + s B A in W's dtype, rounded with `hashed_noise` (`delta`: s B A in float32)."""
    return stochastic_round(delta + weight.float(), weight.dtype, hashed_noise(delta.numel(), keys))


@functools.cache
def _compiled_round_merge_hashed():
    # Flat inputs of any length share one graph (dynamic=True): the adapted weights' shapes differ.
    return torch.compile(round_merge_hashed, dynamic=True, fullgraph=True)


def _keys_by_device(seed: int, layers: list[torch.nn.Module]) -> dict[torch.device, torch.Tensor]:
    """Every layer's `rounding_keys` (row = its number), copied once to each device that holds
    one: a copy per layer would make the host wait for the device's queue at every layer."""
    keys = torch.stack([rounding_keys(seed, number) for number in range(len(layers))]) if layers else None
    devices = {layer.base_layer.weight.device for layer in layers}
    return {device: keys.to(device) for device in devices}


def mergeable_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The LoRA Linears under `module` on the trainer's forward (flowrl.models.lora) whose active
    adapters are plain low-rank terms over a Linear: those a merged weight stands for."""
    return [
        layer
        for layer in module.modules()
        if getattr(layer, "_flowrl_lora_forward", False)
        and isinstance(layer.base_layer, torch.nn.Linear)
        and not (layer.disable_adapters or layer.merged or layer.lora_variant)
    ]


def merged_copy_bytes(layers: list[torch.nn.Module]) -> dict[torch.device, int]:
    """Memory merging `layers` (`mergeable_layers`) allocates, by device: one copy of each
    layer's base weight, in its dtype."""
    need: dict[torch.device, int] = {}
    for layer in layers:
        weight = layer.base_layer.weight
        need[weight.device] = need.get(weight.device, 0) + weight.numel() * weight.element_size()
    return need


def check_merge_fits(layers: list[torch.nn.Module]) -> None:
    """RuntimeError naming rollout.merge_lora when a device lacks the free memory for its part of
    the merged copy of `layers` (module docstring)."""
    from flowrl.models.base import free_memory_bytes

    for device, nbytes in merged_copy_bytes(layers).items():
        free = free_memory_bytes(device)
        if nbytes > free:
            raise RuntimeError(
                f"rollout.merge_lora=true needs {nbytes / 2**30:.1f} GiB on {device} for the merged copy of the "
                f"adapted weights, and {free / 2**30:.1f} GiB is free there: set rollout.merge_lora=false (the "
                "rollouts then run the adapter itself, a little slower) or free that memory "
                "(model.offload_text_encoders=true, fewer adapted modules, a smaller engine.max_batch_rows)"
            )


def merged_weight_of(layer: torch.nn.Module, noise: torch.Tensor | torch.Generator) -> torch.Tensor:
    """W + s B A of one LoRA Linear, stochastically rounded to W's dtype: with a tensor `noise`,
    the layer's `rounding_keys`, in one compiled kernel of `hashed_noise`; with a generator, on
    noise drawn from it."""
    weight = layer.base_layer.weight
    delta = adapter_delta(layer)
    if isinstance(noise, torch.Generator):
        return stochastic_round(delta.add_(weight), weight.dtype, drawn_noise(weight.shape, noise))
    return _compiled_round_merge_hashed()(delta.view(-1), weight.view(-1), noise).view(weight.shape)


@contextlib.contextmanager
def merged_lora(module: torch.nn.Module, seed: int, compiled: bool = False) -> Iterator[int]:
    """Inside the block, every forward without grad of `module` computes its mergeable LoRA
    Linears with merged weights (module docstring); yields how many. The merged weights are
    dropped on the way out, whatever ends the block.

    compiled: bfloat16 weights round in one compiled kernel per layer (torch.compile, compiled
    at the first merge) on `hashed_noise`; otherwise (and for float16, whose neighbour search,
    torch.nextafter, inductor computes in float32) on noise drawn from a generator seeded with
    `seed`, layer after layer. Either is a function of the seed; the two round differently."""
    layers = mergeable_layers(module)
    check_merge_fits(layers)
    try:
        with torch.no_grad():
            keys = _keys_by_device(seed, layers) if compiled else {}
            generators: dict[torch.device, torch.Generator] = {}
            for number, layer in enumerate(layers):
                weight = layer.base_layer.weight
                if compiled and weight.dtype == torch.bfloat16 and fits_hashed_noise(weight.numel()):
                    noise = keys[weight.device][number]
                else:
                    if weight.device not in generators:
                        generators[weight.device] = torch.Generator(device=weight.device).manual_seed(seed)
                    noise = generators[weight.device]
                setattr(layer, MERGED_WEIGHT, merged_weight_of(layer, noise))
        yield len(layers)
    finally:
        for layer in layers:
            if hasattr(layer, MERGED_WEIGHT):
                delattr(layer, MERGED_WEIGHT)
