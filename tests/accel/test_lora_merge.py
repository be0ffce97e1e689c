"""Training rollouts on merged LoRA weights (flowrl.accel.lora_merge, rollout.merge_lora): the
stochastic rounding is unbiased and lands on a neighbour; a merge keeps a change that rounding to
nearest would lose; merged weights serve only forwards without grad and only inside the block;
a float32 run with merged rollouts trains as the run without; the config refuses what it cannot do."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowrl.accel.lora_merge import (
    NOISE_BITS,
    drawn_noise,
    hashed_noise,
    merged_lora,
    round_merge_hashed,
    rounding_keys,
    stochastic_round,
)
from flowrl.models.lora import MERGED_WEIGHT, inject_lora


def _adapted(dtype=torch.float32, width=32, b_std=0.1, w_std=0.05):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width)).to(dtype)
    with torch.no_grad():
        for layer in module:
            layer.weight.normal_(std=w_std)
    inject_lora(module, 4, ["0", "1"])
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.normal_(std=b_std)
    return module


def _delta(layer) -> torch.Tensor:
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    return s * b @ a


def _noise(source: str, shape, seed: int = 0) -> torch.Tensor:
    if source == "drawn":
        return drawn_noise(torch.Size(shape), torch.Generator().manual_seed(seed))
    return hashed_noise(math.prod(shape), rounding_keys(seed, 0)).view(shape)


@pytest.mark.parametrize("source", ["drawn", "hashed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased(dtype, source):
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    rounded = stochastic_round(values, dtype, _noise(source, values.shape))
    assert rounded.dtype == dtype
    nearest = values.to(dtype)
    away = torch.nextafter(nearest, torch.where(values > nearest.float(), torch.inf, -torch.inf).to(dtype))
    assert torch.all((rounded == nearest) | (rounded == away))
    assert (rounded != nearest).any()  # some entries do go the other way
    exact = nearest.float()  # values the dtype holds stay as they are
    assert torch.equal(stochastic_round(exact, dtype, _noise(source, values.shape)), nearest)
    # One value a third of the way between two neighbours: the draws average to it.
    lower = torch.tensor(1.0, dtype=dtype)
    upper = torch.nextafter(lower, torch.tensor(2.0, dtype=dtype))
    value = lower.float() + (upper.float() - lower.float()) / 3
    draws = stochastic_round(value.expand(200_000).contiguous(), dtype, _noise(source, (200_000,))).float()
    assert set(draws.unique().tolist()) == {lower.item(), upper.item()}
    assert draws.mean().item() == pytest.approx(value.item(), abs=(upper - lower).item() * 0.01)


def test_hashed_noise_is_uniform_and_unrelated_across_layers_and_seeds():
    """The compiled merge's noise (a hash of the entry's index): uniform over its 2^16 values,
    each bit set about half the time, uncorrelated between two layers' or two seeds' keys, and
    the same for the same keys."""
    n = 1 << 18
    noise = hashed_noise(n, rounding_keys(7, 0))
    assert torch.equal(noise, hashed_noise(n, rounding_keys(7, 0)))
    assert 0 <= noise.min() and noise.max() < 1 << NOISE_BITS
    set_share = torch.stack([(noise >> b) & 1 for b in range(NOISE_BITS)]).float().mean(dim=1)
    assert torch.all((set_share - 0.5).abs() < 0.01), set_share
    counts = torch.histc(noise.float(), bins=16, min=0, max=1 << NOISE_BITS)
    assert torch.all((counts / (n / 16) - 1).abs() < 0.05), counts
    for other_keys in (rounding_keys(7, 1), rounding_keys(8, 0)):
        other = hashed_noise(n, other_keys)
        assert abs(torch.corrcoef(torch.stack([noise.float(), other.float()]))[0, 1].item()) < 0.01
        assert not torch.equal(noise, other)


def _unsigned_hash32_reference(x: torch.Tensor) -> torch.Tensor:
    """The hash as written for unsigned 32-bit integers, in int64 with every product reduced
    modulo 2^32 (nothing here can overflow)."""
    for shift, multiplier in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
        x = ((x ^ (x >> shift)) * multiplier) & 0xFFFFFFFF
    return x ^ (x >> 15)


def test_hashed_noise_in_int32_is_the_unsigned_hash():
    """hashed_noise computes in int32, where products wrap and shifts are masked to logical ones:
    its noise equals the unsigned 32-bit hash's, computed without any overflow, entry for entry
    (eagerly and compiled), over indices and keys with the sign bit set and clear."""
    n = 1 << 16
    for seed, layer_number in ((0, 0), (3, 11), (123456789, 719)):
        keys = rounding_keys(seed, layer_number)
        assert keys.dtype == torch.int32
        unsigned_keys = keys.to(torch.int64) & 0xFFFFFFFF
        index = torch.arange(n, dtype=torch.int64)
        expected = _unsigned_hash32_reference(_unsigned_hash32_reference(index ^ unsigned_keys[0]) ^ unsigned_keys[1])
        expected = expected & ((1 << NOISE_BITS) - 1)
        assert torch.equal(hashed_noise(n, keys).to(torch.int64), expected)
    assert (rounding_keys(0, 0) < 0).all()  # keys with the sign bit set are among those above
    compiled = torch.compile(hashed_noise, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(n, keys), hashed_noise(n, keys))
    with pytest.raises(ValueError, match="2147483648 entries do not fit int32 indices"):
        hashed_noise(1 << 31, keys)  # refused before any work


def test_the_compiled_rounding_kernel_computes_what_its_function_does_and_compiles_once():
    """merged_lora(compiled=True) rounds bf16 weights with torch.compile(round_merge_hashed): its
    values equal the function's own, entry for entry; merges of new seeds and of other layer
    shapes compile nothing new; the same seed gives the same merge, another seed another."""
    from torch._dynamo.utils import counters

    module = _adapted(torch.bfloat16, width=48)
    merges = []
    for seed in (5, 5, 6):
        with merged_lora(module, seed, compiled=True) as count:
            assert count == 2
            merges.append([getattr(layer, MERGED_WEIGHT).clone() for layer in module])
    for number, layer in enumerate(module):
        weight = layer.base_layer.weight
        delta = _delta(layer).detach().float().reshape(-1)
        expected = round_merge_hashed(delta, weight.reshape(-1), rounding_keys(5, number)).view(weight.shape)
        assert merges[0][number].dtype == torch.bfloat16 and torch.equal(merges[0][number], expected)
    assert all(torch.equal(a, b) for a, b in zip(merges[0], merges[1]))
    assert not any(torch.equal(a, b) for a, b in zip(merges[0], merges[2]))
    graphs = counters["stats"]["unique_graphs"]
    with merged_lora(_adapted(torch.bfloat16, width=40), seed=7, compiled=True):
        pass
    assert counters["stats"]["unique_graphs"] == graphs


def test_float32_merges_without_rounding():
    module = _adapted()
    with merged_lora(module, seed=0) as count:
        assert count == 2
        for layer in module:
            merged = getattr(layer, MERGED_WEIGHT)
            torch.testing.assert_close(merged, layer.base_layer.weight + _delta(layer))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_small_change_survives_the_merge_on_average_where_rounding_to_nearest_loses_it(compiled):
    """bf16 weights of about 0.05 have a unit in the last place of 1.2e-4 to 2.4e-4: an adapter
    that moved them by about 1.5e-5 leaves most of them as they were when rounded to nearest, and
    survives stochastic rounding on average (the merged weights' change regresses onto it with
    slope 1; to nearest, only the entries near zero keep theirs)."""
    module = _adapted(torch.bfloat16, width=256, b_std=2e-5)
    layer = module[0]
    base, delta = layer.base_layer.weight.float(), _delta(layer).detach().float()
    assert 1e-5 < delta.abs().mean() < 1e-4

    def slope(change: torch.Tensor) -> float:
        return ((change * delta).sum() / delta.square().sum()).item()

    nearest = (base + delta).to(torch.bfloat16).float() - base
    assert (nearest != 0).float().mean() < 0.15 and slope(nearest) < 0.4
    with merged_lora(module, seed=0, compiled=compiled):
        change = getattr(layer, MERGED_WEIGHT).float() - base
    assert slope(change) == pytest.approx(1.0, abs=0.1)


def test_merged_weights_serve_forwards_without_grad_inside_the_block_only():
    module = _adapted(torch.bfloat16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    adapter_out = module(x)
    seen = {}
    with merged_lora(module, seed=0):
        layer = module[0]
        merged = getattr(layer, MERGED_WEIGHT)
        assert merged.dtype == torch.bfloat16 and not torch.equal(merged, layer.base_layer.weight)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, merged, layer.base_layer.bias), atol=0, rtol=0)
        out = module(x)  # with grad: the adapter itself, whose gradients reach the LoRA weights
        assert torch.equal(out, adapter_out)
        out.float().square().sum().backward()
        seen["grad"] = layer.lora_B["default"].weight.grad
    assert seen["grad"] is not None and seen["grad"].abs().sum() > 0
    assert not any(hasattr(layer, MERGED_WEIGHT) for layer in module)
    with torch.no_grad():
        assert torch.equal(module(x), adapter_out)


def test_merged_weights_are_dropped_when_the_block_fails_and_a_seed_gives_one_merge():
    module = _adapted(torch.bfloat16)
    merges = []
    for seed in (3, 3, 4):
        with merged_lora(module, seed):
            merges.append(getattr(module[1], MERGED_WEIGHT).clone())
    assert torch.equal(merges[0], merges[1]) and not torch.equal(merges[0], merges[2])
    with pytest.raises(RuntimeError, match="stop"), merged_lora(module, seed=0):
        raise RuntimeError("stop")
    assert not any(hasattr(layer, MERGED_WEIGHT) for layer in module)


def test_a_merge_the_device_cannot_hold_is_refused_naming_the_setting_before_any_copy(monkeypatch):
    """The merged copy is one more copy of every adapted base weight (two 32 x 32 bfloat16 weights:
    4 KiB here); with less free memory than that the merge stops with the setting and its fix
    named, before any merged weight exists, where it would otherwise fail out of memory halfway."""
    import flowrl.models.base as base
    from flowrl.accel.lora_merge import mergeable_layers, merged_copy_bytes

    module = _adapted(torch.bfloat16)
    assert merged_copy_bytes(mergeable_layers(module)) == {torch.device("cpu"): 2 * 32 * 32 * 2}
    merged = []
    monkeypatch.setattr(base, "free_memory_bytes", lambda device: 4095)
    with pytest.raises(RuntimeError, match=r"rollout\.merge_lora=true needs 0\.0 GiB.*rollout\.merge_lora=false"):
        with merged_lora(module, seed=0):
            merged.append(True)
    assert not merged and not any(hasattr(layer, MERGED_WEIGHT) for layer in module)
    monkeypatch.setattr(base, "free_memory_bytes", lambda device: 4096)
    with merged_lora(module, seed=0):
        assert all(hasattr(layer, MERGED_WEIGHT) for layer in module)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["trainer.lora.enabled=false"], "rollout.merge_lora"),
        (["algorithm.old_log_prob=rollout"], "algorithm.old_log_prob"),
        (["rollout.servers=[http://127.0.0.1:9]"], "rollout.merge_lora"),
    ],
    ids=["no-adapter", "rollout-denominators", "rollout-servers"],
)
def test_the_config_refuses_a_merge_it_cannot_make(make_cfg, overrides, field):
    ok = ("rollout.merge_lora=true", "trainer.lora.enabled=true", "algorithm.old_log_prob=recompute")
    make_cfg(*ok)
    with pytest.raises(ValueError, match=rf"{field}=.*set .*merge_lora=false"):
        make_cfg(*ok, *overrides)


def test_a_float32_run_on_merged_rollouts_trains_as_the_run_on_the_adapter(build_trainer, make_cfg):
    """In float32 the merge rounds nothing beyond float32, so the run's rollouts, rewards and
    updates follow the unmerged run's; the merged weights exist during the training rollouts
    only (validation samples the adapter itself), and the step's second rollout merges the
    adapter the first update trained."""
    overrides = (
        "trainer.lora.enabled=true",
        "algorithm.old_log_prob=recompute",
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.lr=0.01",
        "trainer.num_val_images=2",
    )
    runs = {}
    for merge in (False, True):
        trainer = build_trainer(make_cfg(*overrides, f"rollout.merge_lora={merge}", output=f"merge-{merge}"))
        layers = [m for m in trainer.adapter.transformer.modules() if hasattr(m, "lora_A")]
        merged_during = []  # (validation, merged layers) per rollout
        assert trainer.val_agent_loop is trainer.agent_loop

        def recording(*args, _generate=trainer.agent_loop.generate_sequences, _layers=layers, **kwargs):
            merged_during.append((kwargs.get("validation", False), sum(hasattr(m, MERGED_WEIGHT) for m in _layers)))
            return _generate(*args, **kwargs)

        trainer.agent_loop.generate_sequences = recording
        steps = [trainer.train_step() for _ in range(2)]
        trainer.validate()
        assert not any(hasattr(m, MERGED_WEIGHT) for m in layers)
        runs[merge] = (steps, merged_during, [p.detach().clone() for p in trainer.algorithm.updater.params])
    (plain, none_merged, plain_weights), (merged, all_merged, merged_weights) = runs[False], runs[True]
    assert none_merged == [(False, 0), (False, 0), (True, 0)] and len(layers) > 0
    assert all_merged == [(False, len(layers)), (False, len(layers)), (True, 0)]
    assert merged[1]["rollout/policy_version"] == 1  # the second rollout merged the trained adapter
    for a, b in zip(plain, merged):
        assert "timing/lora_merge_s" not in a and 0 < b["timing/lora_merge_s"] < b["timing/rollout_s"]
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-4)
        assert b["actor/logprob_gap_max"] < 1e-3
    for a, b in zip(plain_weights, merged_weights):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def _record_merges(monkeypatch) -> list[tuple[int, bool]]:
    """The (seed, compiled) of every merged_lora call the trainer makes from here on."""
    import flowrl.accel.lora_merge as lora_merge

    calls = []
    real = lora_merge.merged_lora

    def recording(module, seed, compiled=False):
        calls.append((seed, compiled))
        return real(module, seed, compiled)

    monkeypatch.setattr(lora_merge, "merged_lora", recording)
    return calls


@pytest.mark.parametrize("compile_engine", [False, True])
def test_the_trainer_compiles_the_merge_exactly_when_it_compiles_the_engine(
    build_trainer, make_cfg, monkeypatch, compile_engine
):
    """A training rollout's merge rounds in the compiled kernel with engine.compile and on drawn
    noise without it, under the seed of (rollout.seed, policy version)."""
    calls = _record_merges(monkeypatch)
    cfg = make_cfg(
        "trainer.lora.enabled=true",
        "algorithm.old_log_prob=recompute",
        "rollout.merge_lora=true",
        "rollout.seed=3",
        f"engine.compile={str(compile_engine).lower()}",
        output=f"merge-compiled-{compile_engine}",
    )
    trainer = build_trainer(cfg)
    calls.clear()  # the merges that counted a merged rollout's FLOPs (flowrl.run.step_flops), with seed 0
    with trainer.rollout_weights():
        pass
    assert calls == [(int(np.random.SeedSequence([3, trainer.policy_version]).generate_state(1)[0]), compile_engine)]


def test_without_a_rollout_seed_every_rank_merges_with_rank_zeros_fresh_seed(build_trainer, make_cfg, monkeypatch):
    """rollout.seed=null: the merge's seed is fresh randomness that rank 0 broadcasts, so the ranks
    of a run still merge the same weights."""
    calls, broadcast = _record_merges(monkeypatch), []
    cfg = make_cfg(
        "trainer.lora.enabled=true",
        "algorithm.old_log_prob=recompute",
        "rollout.merge_lora=true",
        "rollout.seed=null",
        output="merge-fresh-seed",
    )
    trainer = build_trainer(cfg)
    calls.clear()  # the FLOP count's merges

    def rank_zeros(world, value):
        broadcast.append(value)
        return 12345  # what rank 0 drew

    monkeypatch.setattr(type(trainer.world), "broadcast", rank_zeros)
    with trainer.rollout_weights():
        pass
    assert len(broadcast) == 1 and [seed for seed, _ in calls] == [12345]
