"""trainer.gradient_checkpointing=auto: the activation count, the decision from measured memory,
and that the choice changes how the update runs, never what it computes."""

import pytest
import torch

from flowrl.trainer import grad_checkpointing as checkpointing
from flowrl.trainer.grad_checkpointing import (
    RESERVE_FRACTION,
    SAFETY_FACTOR,
    choose_checkpointing,
    held_bytes,
    needs_checkpointing,
    saved_activation_bytes,
    set_checkpointing,
)


def checkpointing_enabled(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s modules has diffusers' checkpointing switch on."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def _frozen_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    for p in model.parameters():
        p.requires_grad_(False)
    model[0].weight.requires_grad_(True)  # one trained weight, as a LoRA factor is
    return model


def test_saved_activations_scale_with_the_batch_leave_out_the_weights_and_touch_no_gradient():
    model = _frozen_mlp()
    one = saved_activation_bytes(lambda: model(torch.randn(8, 16)), model)
    two = saved_activation_bytes(lambda: model(torch.randn(16, 16)), model)
    assert one > 0 and two == 2 * one
    # What the backward reads besides the weights: the first layer's input (8 x 16 floats: the
    # trained weight's gradient needs it) and the GELU's input (8 x 64). The frozen last layer's
    # input gradient needs only its weight, which is not counted.
    assert one == 4 * 8 * (16 + 64)
    assert all(p.grad is None for p in model.parameters())


def test_the_bytes_a_run_holds_leave_out_earlier_garbage_that_a_collection_inside_it_frees():
    """On CUDA the probe counts what the allocator holds more while the graph is alive. A compile
    inside the probe runs Python's collector, which can free an earlier reference cycle holding
    device memory; that must not be subtracted (a tiny model's probe measured 0 bytes so)."""
    import gc
    import weakref

    allocated = [0]

    def free(num_bytes: int) -> None:
        allocated[0] -= num_bytes

    class Cycle:  # earlier work's garbage: a reference cycle that owns 1000 bytes
        def __init__(self):
            allocated[0] += 1000
            self.me = self
            weakref.finalize(self, free, 1000)

    gc.disable()  # the cycle stays uncollected until a collection runs, as between two collections
    try:
        Cycle()

        def run():
            allocated[0] += 100  # what the graph holds
            gc.collect()  # as compiling the graph does
            return object()

        assert held_bytes(run, lambda: allocated[0]) == 100
    finally:
        gc.enable()


def test_a_micro_batch_needs_checkpoints_only_when_its_planned_activations_exceed_free_memory_less_the_reserve():
    sample, free = 1000.0, 10_000.0
    fits = int(free * (1 - RESERVE_FRACTION) / (sample * SAFETY_FACTOR))
    assert needs_checkpointing(sample, fits, free) == (False, sample * fits * SAFETY_FACTOR)
    assert needs_checkpointing(sample, fits + 1, free)[0] is True


def _block_model():
    """A module tree with diffusers' checkpointing switch on two blocks."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    for block in model.blocks:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = "flowrl's function"
    return model


def test_the_switch_keeps_the_checkpoint_function_it_was_enabled_with():
    model = _block_model()
    set_checkpointing(model, False)
    assert not checkpointing_enabled(model)
    assert all(block._gradient_checkpointing_func == "flowrl's function" for block in model.blocks)
    set_checkpointing(model, True)
    assert checkpointing_enabled(model)


@pytest.mark.parametrize(
    ("free_bytes", "probe_raises", "enabled"),
    [(10**12, False, False), (100, False, True), (10**12, True, True)],
    ids=["fits", "does-not-fit", "probe-out-of-memory"],
)
def test_auto_decides_from_the_probe_and_the_free_memory(monkeypatch, free_bytes, probe_raises, enabled):
    model = _block_model()
    seen_checkpointing = []

    def probe():
        seen_checkpointing.append(checkpointing_enabled(model))
        if probe_raises:
            raise torch.OutOfMemoryError("probe")
        return model.blocks[0](torch.randn(6, 4, requires_grad=True))

    monkeypatch.setattr(checkpointing, "free_memory_bytes", lambda device: free_bytes)
    choice = choose_checkpointing("auto", model, probe, 3, 4, torch.device("cpu"))
    assert seen_checkpointing == [False]  # the probe measures the update without checkpoints
    assert choice.enabled is enabled and checkpointing_enabled(model) is enabled
    assert choice.measured and choice.free_bytes == free_bytes
    if not probe_raises:
        assert choice.sample_bytes == 6 * 4 * 4 / 3  # the input the weight gradient needs, per sample
    assert choice.metrics()["memory/gradient_checkpointing"] == float(enabled)


def test_auto_agrees_over_ranks_on_the_largest_need_and_the_smallest_free_memory(monkeypatch):
    model = _block_model()
    monkeypatch.setattr(checkpointing, "free_memory_bytes", lambda device: 10**12)
    # Another rank reports 100 bytes free: every rank then turns checkpointing on.
    choice = choose_checkpointing(
        "auto",
        model,
        lambda: model.blocks[0](torch.randn(2, 4, requires_grad=True)),
        1,
        4,
        torch.device("cpu"),
        agree_max=lambda values: [values[0], max(values[1], -100.0), values[2]],
    )
    assert choice.enabled and choice.free_bytes == 100.0


def test_fixed_settings_are_kept_without_a_probe():
    model = _block_model()

    def probe():
        raise AssertionError("true/false never probe")

    assert choose_checkpointing(True, model, probe, 1, 4, torch.device("cpu")).enabled is True
    assert choose_checkpointing(False, model, probe, 1, 4, torch.device("cpu")).measured is False


def _trained_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("free_bytes", [10**12, 0], ids=["auto-off", "auto-on"])
def test_auto_trains_exactly_as_the_fixed_setting_it_chose(build_trainer, make_cfg, monkeypatch, free_bytes):
    """Two steps with `auto` (memory plenty: off; none: on) give the weights and metrics of the
    same run with the setting fixed, and the blocks' switch is where the choice put it."""
    monkeypatch.setattr(checkpointing, "free_memory_bytes", lambda device: free_bytes)
    run = ("trainer.total_steps=2", "rollout.n=2", "trainer.prompts_per_step=2", "trainer.micro_batch_size=2")
    auto = build_trainer(make_cfg(*run, "trainer.gradient_checkpointing=auto", output="auto"))
    auto.fit()
    expected = free_bytes == 0
    fixed = build_trainer(make_cfg(*run, f"trainer.gradient_checkpointing={str(expected).lower()}", output="fixed"))
    fixed.fit()
    assert auto.algorithm.updater.checkpointing.measured and auto.algorithm.updater.checkpointing.enabled is expected
    assert checkpointing_enabled(auto.adapter.transformer) is expected
    weights, reference = _trained_weights(auto), _trained_weights(fixed)
    assert weights.keys() == reference.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=0, msg=name)
