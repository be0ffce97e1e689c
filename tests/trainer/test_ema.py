"""trainer.ema: the moving average's arithmetic, validation sampling with it (and the trained
weights back after), and its place in checkpoints and the final weights."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flowrl.run.checkpoint import latest_checkpoint
from flowrl.trainer.ema import ParameterEMA


def test_average_moves_when_the_next_count_is_a_multiple_with_the_warm_up_decay():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = ParameterEMA({"w": p}, decay=0.9, update_every=2)
    with torch.no_grad():
        p.fill_(1.0)
    assert not ema.step(2) and torch.equal(ema.averages["w"], torch.zeros(3))
    assert ema.step(3)  # (3 + 1) % 2 == 0, as Flow-GRPO's EMA tests (count + 1) % interval
    d = min(0.9, 4 / 13)  # the warm-up: (1 + t) / (10 + t) at t = 3
    torch.testing.assert_close(ema.averages["w"], torch.full((3,), 1 - d))
    assert ema.current_decay(1000) == 0.9 and ema.num_updates == 1


def _reference_loop_lag(micro_batches: int, optimizer_steps: int, decay=0.9, interval=8) -> list[float]:
    """Flow-GRPO's training loop on a weight that grows by 1 per optimizer step, written from its
    scripts/train_sd3.py and flow_grpo/ema.py: per process, each micro-batch backpropagates, the
    last of each accumulation group steps the optimizer (global_step += 1), and after EVERY
    micro-batch the EMA is called with global_step, moving by (1 - d(global_step)) when
    (global_step + 1) % interval == 0. Returns weight - average after each optimizer step's group."""
    average, global_step, lags = 0.0, 0, []
    for _ in range(optimizer_steps):
        for i in range(micro_batches):
            if i == micro_batches - 1:
                global_step += 1  # the accumulation group's optimizer step: the weight is now global_step
            if (global_step + 1) % interval == 0:
                d = min((1 + global_step) / (10 + global_step), decay)
                average += (1 - d) * (global_step - average)
        lags.append(global_step - average)
    return lags


def _flowrl_lag(moves: int, optimizer_steps: int) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    ema = ParameterEMA({"w": p}, decay=0.9, update_every=8, moves_per_update=moves)
    lags = []
    for t in range(1, optimizer_steps + 1):
        with torch.no_grad():
            p.fill_(float(t))
        ema.step(t)
        lags.append(t - float(ema.averages["w"]))
    return lags


@pytest.mark.parametrize("micro_batches", [1, 2, 6])  # 2: the SD3.5 recipes' reference, 6: FLUX's
def test_horizon_on_a_ramp_equals_the_reference_loop(micro_batches):
    """trainer.ema.moves_per_update set to the reference run's micro-batches per optimizer step
    keeps its horizon: the average's lag behind a steadily moving weight (after the warm-up) is the
    reference loop's within 10%; one move per count (the old cadence) lags far more."""
    steps, settled = 800, slice(300, None)
    reference = np.mean(_reference_loop_lag(micro_batches, steps)[settled])
    ours = np.mean(_flowrl_lag(micro_batches, steps)[settled])
    assert abs(ours - reference) <= 0.1 * reference, (ours, reference)
    if micro_batches > 1:
        assert np.mean(_flowrl_lag(1, steps)[settled]) > 1.5 * reference


def test_applied_swaps_the_average_in_and_the_trained_values_back():
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    trained = p.detach().clone()
    ema = ParameterEMA({"w": p}, decay=0.5, update_every=1)
    ema.averages["w"] = torch.full((4,), 0.25)
    with ema.applied():
        assert torch.equal(p.detach(), torch.full((4,), 0.25, dtype=torch.bfloat16))
    assert torch.equal(p.detach(), trained)
    with pytest.raises(RuntimeError), ema.applied():
        raise RuntimeError("validation failed")
    assert torch.equal(p.detach(), trained)  # restored on errors too


def test_state_round_trip_and_mismatch_errors():
    p = torch.nn.Parameter(torch.randn(2, 3))
    ema = ParameterEMA({"w": p}, decay=0.9, update_every=1)
    ema.step(1)
    tensors, meta = ema.state_dict()
    other = ParameterEMA({"w": torch.nn.Parameter(torch.zeros(2, 3))}, decay=0.9, update_every=1)
    other.load_state_dict(tensors, meta)
    assert torch.equal(other.averages["w"], ema.averages["w"]) and other.num_updates == 1
    with pytest.raises(ValueError, match="missing"):
        ParameterEMA({"v": p}, 0.9, 1).load_state_dict(tensors, meta)
    with pytest.raises(ValueError, match="shape"):
        ParameterEMA({"w": torch.nn.Parameter(torch.zeros(3))}, 0.9, 1).load_state_dict(tensors, meta)


def test_validation_samples_with_the_average_and_checkpoints_save_it(build_trainer, make_cfg):
    cfg = make_cfg(
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.lora.enabled=true",
        "trainer.lr=0.05",
        "trainer.ema.enabled=true",
        "trainer.ema.update_every=1",
        "trainer.num_val_images=2",
        "trainer.total_steps=2",
        "trainer.save_every=2",
    )
    trainer = build_trainer(cfg)
    trainer.train_step()
    trainer.train_step()
    ema, params = trainer.ema, dict(trainer.adapter.transformer.named_parameters())
    assert trainer.algorithm.updater.ema is ema and ema.num_updates == 2
    trained = {name: params[name].detach().clone() for name in ema.averages}
    assert any(not torch.equal(ema.averages[n], trained[n]) for n in trained)
    seen = {}
    generate = trainer.agent_loop.generate_sequences

    def spy(batch, validation=False, **kwargs):
        seen["weights"] = {name: params[name].detach().clone() for name in ema.averages}
        return generate(batch, validation=validation, **kwargs)

    trainer.agent_loop.generate_sequences = spy
    assert "val/reward_mean" in trainer.validate()
    for name in trained:  # sampled with the average; the trained weights back afterwards
        assert torch.equal(seen["weights"][name], ema.averages[name])
        assert torch.equal(params[name].detach(), trained[name])
    saved = trainer.save()
    ema_file, weights_file = load_file(str(saved / "ema.safetensors")), load_file(str(saved / "trainable.safetensors"))
    assert ema_file.keys() == weights_file.keys()
    for name in ema_file:
        assert torch.equal(ema_file[name], ema.averages[name]) and torch.equal(weights_file[name], trained[name])
    assert latest_checkpoint(cfg.trainer.output_dir) == saved
    final = trainer.save_final()
    assert (final / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (trainer.output_dir / "final" / "ema" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    trainer.scorer.close()
