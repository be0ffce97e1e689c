"""Qwen-Image's per-timestep modulation table (flowrl.accel.qwen_image.modulation, read through
the adapter's call hook): the blocks' function unchanged, one build per weight version and
schedule, rebuilt after in-place weight updates, never used with grad, skipped where it cannot
reproduce the block, and off with `modulation_table=False`."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.accel.options import AccelOptions
from flowrl.accel.qwen_image import install, modulation
from flowrl.bench.models import build_bench_model
from flowrl.engine import DiffusionEngine, SamplingParams


@pytest.fixture(scope="module")
def stock():
    torch.manual_seed(0)
    return build_bench_model("tiny-qwen", "cpu", torch.float32).adapter


@pytest.fixture
def prepared(stock):
    adapter = copy.deepcopy(stock)
    install(adapter)  # what compile_adapter installs, without compiling
    return adapter


def _args(adapter, sigma_values, cfg=False):
    rows = len(sigma_values)
    enc = adapter.encode_prompts(["long prompt", "short", "x"][:rows])
    uncond = adapter.encode_prompts([""] * rows) if cfg else [None] * rows
    latents = torch.randn((rows, *adapter.latent_shape(64, 64)), generator=torch.Generator().manual_seed(3))
    return (latents, torch.tensor(sigma_values), enc, uncond, torch.full((rows,), 3.0), 64, 64)


def _velocities(adapter, sigma_values, cfg=False):
    args = _args(adapter, sigma_values, cfg)
    with torch.no_grad():
        return adapter.velocity(*args), adapter.velocity(*args, sigma_values=sigma_values)


@pytest.mark.parametrize("steps, cfg", [([0, 3, 3], False), ([1, 5], True), ([2], False)])
def test_table_rows_give_the_blocks_own_modulation(prepared, steps, cfg):
    sigmas = prepared.sigmas(8, 64, 64).tolist()
    direct, table = _velocities(prepared, [sigmas[i] for i in steps], cfg)
    torch.testing.assert_close(table, direct, atol=2e-6, rtol=1e-6)  # float32: GEMM row-count rounding only
    assert prepared.transformer_call_hook.table.builds == 1
    # The build covered the whole schedule: every step of it is a table row.
    assert set(sigmas) <= set(prepared.transformer_call_hook.table.keys)
    block = prepared.transformer.transformer_blocks[0]
    assert block._flowrl_modulation.shape == (2, modulation.MIN_CAPACITY, block.img_mod[1].out_features)


def test_rows_with_and_without_cfg_in_one_forward(prepared):
    """Some rows use CFG, some do not: the uncond rows (appended after every cond row) find the
    table rows of their own sigmas."""
    sigmas = prepared.sigmas(8, 64, 64).tolist()
    values = [sigmas[1], sigmas[5], sigmas[2]]
    latents, sigma, cond, _, guidance, h, w = _args(prepared, values)
    uncond = [prepared.encode_prompts([""])[0], None, prepared.encode_prompts(["neg"])[0]]
    with torch.no_grad():
        direct = prepared.velocity(latents, sigma, cond, uncond, guidance, h, w)
        table = prepared.velocity(latents, sigma, cond, uncond, guidance, h, w, sigma_values=values)
    torch.testing.assert_close(table, direct, atol=2e-6, rtol=1e-6)
    assert prepared.transformer_call_hook.table.builds == 1


def test_in_place_weight_updates_rebuild_the_table(prepared):
    sigmas = prepared.sigmas(8, 64, 64).tolist()
    values = [sigmas[2], sigmas[4]]
    _velocities(prepared, values)
    _velocities(prepared, values)
    assert prepared.transformer_call_hook.table.builds == 1  # nothing changed: no second build
    block = prepared.transformer.transformer_blocks[1]
    embed = prepared.transformer.time_text_embed.timestep_embedder.linear_2
    for update in (
        lambda: block.txt_mod[1].weight.add_(0.05),  # an optimizer step's kind of write
        lambda: block.img_mod[1].bias.copy_(torch.randn_like(block.img_mod[1].bias)),  # load_state_dict
        lambda: embed.weight.mul_(1.1),
    ):  # the time embedding feeds every row of the table
        builds = prepared.transformer_call_hook.table.builds
        with torch.no_grad():
            update()
        direct, table = _velocities(prepared, values)
        assert prepared.transformer_call_hook.table.builds == builds + 1
        torch.testing.assert_close(table, direct, atol=2e-6, rtol=1e-6)


def test_capacity_grows_in_powers_of_two(prepared):
    schedule = prepared.sigmas(80, 64, 64).tolist()  # 81 keys
    _velocities(prepared, schedule[:2])
    block = prepared.transformer.transformer_blocks[0]
    assert block._flowrl_modulation.shape[1] == 128
    direct, table = _velocities(prepared, [0.123, schedule[7]])  # a key outside every schedule
    torch.testing.assert_close(table, direct, atol=2e-6, rtol=1e-6)
    assert prepared.transformer_call_hook.table.keys[0.123] == len(prepared.transformer_call_hook.table.keys) - 1


def test_grad_mode_computes_the_modulation_in_the_forward(prepared):
    """The trainer's forward: no table, and gradients reach the modulation layers."""
    sigmas = prepared.sigmas(8, 64, 64).tolist()
    weight = prepared.transformer.transformer_blocks[0].img_mod[1].weight
    weight.requires_grad_(True)
    out = prepared.velocity(*_args(prepared, [sigmas[1]]), sigma_values=[sigmas[1]])
    out.square().mean().backward()
    assert prepared.transformer_call_hook.table is None
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_table_skipped_where_it_cannot_reproduce_the_block(stock, prepared):
    sigmas = stock.sigmas(8, 64, 64).tolist()
    # diffusers' own blocks (engine.compile off: no sequence-major forward): the hint changes nothing
    eager = copy.deepcopy(stock)
    direct, hinted = _velocities(eager, [sigmas[1]])
    assert eager.transformer_call_hook is None and torch.equal(direct, hinted)
    # a LoRA on a modulation layer: its output is no longer the plain Linear the table holds
    from peft import LoraConfig

    prepared.transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=2, target_modules=["img_mod.1"], init_lora_weights=False)
    )
    assert not modulation.applicable(prepared.transformer)
    direct, hinted = _velocities(prepared, [sigmas[1]])
    assert prepared.transformer_call_hook.table is None and torch.equal(direct, hinted)


def test_switch_off_computes_in_every_forward(prepared):
    install(prepared, AccelOptions(modulation_table=False))
    sigmas = prepared.sigmas(8, 64, 64).tolist()
    direct, hinted = _velocities(prepared, [sigmas[1]])
    assert prepared.transformer_call_hook.table is None and torch.equal(direct, hinted)


def test_engine_rollouts_build_once_per_weight_version(prepared):
    """The engine passes every row's sigma from the host; a rollout builds the table once, the
    next one reuses it, and one after a weight update rebuilds it once."""
    engine = DiffusionEngine(prepared)
    params = SamplingParams(height=64, width=64, num_inference_steps=5, noise_level=0.7, seed=3)
    try:
        first = engine.generate_batched("a cat", 3, params)
        assert prepared.transformer_call_hook.table.builds == 1
        again = engine.generate_batched("a cat", 3, params)
        assert prepared.transformer_call_hook.table.builds == 1
        for a, b in zip(first, again):
            assert torch.equal(a.all_log_probs, b.all_log_probs)
        with torch.no_grad():
            prepared.transformer.transformer_blocks[0].img_mod[1].weight.add_(0.01)
        engine.generate_batched("a cat", 3, params)
        assert prepared.transformer_call_hook.table.builds == 2
    finally:
        engine.shutdown()
