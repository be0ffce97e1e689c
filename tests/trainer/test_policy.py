"""Rollout/trainer agreement on real tiny-SD3 rollouts: the trainer re-scores stored transitions
with the engine's own sampler function (CFG included), so on CPU float32 the log-probs agree."""

import numpy as np
import pytest
import torch

import flowrl.accel
from flowrl.trainer.trainer import FlowGRPOTrainer


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_rollout_log_probs_match_trainer_recompute(make_cfg, take_rollout, guidance):
    cfg = make_cfg(
        "rollout.n=3",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4",
        "algorithm.old_log_prob=recompute",
        f"rollout.sampling.guidance_scale={guidance}",
        "rollout.sampling.negative_prompt=blurry",
    )
    trainer = FlowGRPOTrainer(cfg)
    tensors, specs = take_rollout(trainer)
    if guidance > 1:
        assert "negative_prompt_embeds" in tensors
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    metrics = trainer.updater.update(tensors, specs, advantages, torch.ones(6), step=1)
    # CPU float32: the same function on the same inputs, only the batch composition differs.
    assert metrics["actor/logprob_gap_max"] < 1e-5
    # First update on fresh rollouts with a recomputed denominator: ratio exactly 1, no clipping.
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_max"] == 1.0
    assert metrics["actor/clipfrac"] == 0.0
    assert metrics["actor/grad_norm"] > 0.0


def test_rollout_denominator_gap_and_updates_change_the_policy(make_cfg, take_rollout):
    cfg = make_cfg(
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=2",
        "trainer.updates_per_step=2",
        "algorithm.old_log_prob=rollout",
        "trainer.lr=0.05",
        "algorithm.clip_range=1e-6",
    )
    trainer = FlowGRPOTrainer(cfg)
    tensors, specs = take_rollout(trainer)
    metrics = trainer.updater.update(tensors, specs, torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones(4), step=1)
    assert metrics["actor/logprob_gap_max"] < 1e-5  # measured before the first optimizer step
    assert metrics["actor/num_optimizer_steps"] == 2
    # The second micro-batch is scored after one update: its ratio moved, and the tiny clip caught it.
    assert metrics["actor/ratio_max"] != 1.0 or metrics["actor/ratio_mean"] != 1.0
    assert metrics["actor/clipfrac"] > 0.0


def test_kl_reference_is_the_lora_disabled_model(make_cfg, take_rollout):
    cfg = make_cfg(
        "rollout.n=2",
        "trainer.prompts_per_step=1",
        "algorithm.kl_beta=0.1",
        "trainer.lora.enabled=true",
        "algorithm.old_log_prob=recompute",
    )
    trainer = FlowGRPOTrainer(cfg)
    tensors, specs = take_rollout(trainer)
    adv = torch.tensor([1.0, -1.0])
    # LoRA B starts at zero: the policy IS the reference, so the KL is exactly 0.
    first = trainer.updater.update(tensors, specs, adv, torch.ones(2), step=1)
    assert first["actor/kl"] == 0.0
    with torch.no_grad():
        for name, p in trainer.adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    second = trainer.updater.update(tensors, specs, adv, torch.ones(2), step=2)
    assert second["actor/kl"] > 0.0 and np.isfinite(second["actor/kl"])


def _grad_graph_rounds_differently(monkeypatch, adapter_cls, offset=1e-3):
    """Make the model's grad-mode forward differ from its no-grad forward by `offset`, as a
    compiled model's two graphs may round differently (docs/performance.md)."""
    velocity = adapter_cls.velocity

    def perturbed(self, *args, **kwargs):
        out = velocity(self, *args, **kwargs)
        return out + offset if torch.is_grad_enabled() else out

    monkeypatch.setattr(adapter_cls, "velocity", perturbed)


def test_values_from_no_grad_are_the_no_grad_values_with_the_grad_gradients(make_cfg, take_rollout, monkeypatch):
    from flowrl.models.sd3 import SD3Adapter
    from flowrl.trainer.policy import score_transitions

    trainer = FlowGRPOTrainer(make_cfg("rollout.n=2", "trainer.prompts_per_step=1", "trainer.lora.enabled=true"))
    tensors, specs = take_rollout(trainer)
    adapter, params = trainer.adapter, trainer.updater.params
    with torch.no_grad():  # LoRA B starts at 0: move it so the LoRA weights get gradients of every kind
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    step_index = torch.zeros(2, dtype=torch.long)

    def scored(values_from_no_grad):
        result = score_transitions(adapter, tensors, step_index, specs, values_from_no_grad=values_from_no_grad)
        (result.log_prob.sum() + result.mean.mean()).backward()  # linear: its gradient ignores the values
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return result, grads

    plain, plain_grads = scored(False)
    _grad_graph_rounds_differently(monkeypatch, SD3Adapter)
    with torch.no_grad():
        no_grad = score_transitions(adapter, tensors, step_index, specs)
    graded, graded_grads = scored(False)
    combined, combined_grads = scored(True)
    assert not torch.equal(graded.log_prob, no_grad.log_prob)  # the perturbation shows in the grad pass
    assert torch.equal(combined.log_prob.detach(), no_grad.log_prob)
    assert torch.equal(combined.mean.detach(), no_grad.mean)
    for g, ref in zip(combined_grads, graded_grads):  # the grad pass's gradients
        assert torch.equal(g, ref)
    assert any(g.abs().sum() > 0 for g in combined_grads)
    # Unperturbed (eager CPU), both passes agree: the same values and gradients as a plain grad pass.
    monkeypatch.undo()
    unperturbed, unperturbed_grads = scored(True)
    assert torch.equal(unperturbed.log_prob.detach(), plain.log_prob.detach())
    for g, ref in zip(unperturbed_grads, plain_grads):
        assert torch.equal(g, ref)


@pytest.mark.parametrize("compiled", [False, True])
def test_compiled_trainer_ratio_compares_the_no_grad_graph_with_itself(make_cfg, take_rollout, monkeypatch, compiled):
    """With a compiled model the trainer takes log-prob values from the no-grad graph (the
    rollout's): a grad graph that rounds differently then no longer moves the first update's ratio."""
    from flowrl.models.sd3 import SD3Adapter

    monkeypatch.setattr(flowrl.accel, "compile_adapter", lambda adapter, backend="inductor", rounding="eager": [])
    monkeypatch.setattr(flowrl.accel, "is_compiled", lambda adapter: compiled)
    trainer = FlowGRPOTrainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=2",
            "trainer.micro_batch_size=4",
            "algorithm.old_log_prob=recompute",
            "algorithm.clip_range=1e-6",
            f"engine.compile={str(compiled).lower()}",
        )
    )
    assert trainer.updater.values_from_no_grad is compiled
    tensors, specs = take_rollout(trainer)
    _grad_graph_rounds_differently(monkeypatch, SD3Adapter)
    metrics = trainer.updater.update(tensors, specs, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4), step=1)
    if compiled:
        assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/clipfrac"] == 0.0
    else:  # the grad graph's own values: the ratio moves by the perturbation and gets clipped
        assert metrics["actor/ratio_mean"] != 1.0 and metrics["actor/clipfrac"] > 0.0
    assert metrics["actor/grad_norm"] > 0.0


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_dropout_keeps_the_grad_pass_values(make_cfg, monkeypatch, dropout):
    """With LoRA dropout the train-mode forward is random: a value pass would draw one dropout mask
    and the grad pass another, so a compiled trainer then keeps the grad pass's own values (and
    the recompute's values are not reused for it either)."""
    monkeypatch.setattr(flowrl.accel, "compile_adapter", lambda adapter, backend="inductor", rounding="eager": [])
    monkeypatch.setattr(flowrl.accel, "is_compiled", lambda adapter: True)
    trainer = FlowGRPOTrainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=1",
            "trainer.lora.enabled=true",
            f"trainer.lora.dropout={dropout}",
            "engine.compile=true",
        )
    )
    assert trainer.updater.values_from_no_grad is (dropout == 0.0)
    if dropout:
        transformer = trainer.adapter.transformer
        transformer.train()
        layer = next(m for m in transformer.modules() if hasattr(m, "lora_dropout"))
        x = torch.ones(4, layer.in_features)
        with torch.no_grad():  # the premise: two train-mode passes draw different masks
            assert not torch.equal(layer.lora_dropout["default"](x), layer.lora_dropout["default"](x))
        transformer.eval()


class _CountingTensor(torch.Tensor):
    """Counts Tensor.to calls on itself and on tensors derived from it (slices, rows)."""

    to_calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            cls.to_calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_prompt_encodings_move_once_per_micro_batch_and_trim_each_row():
    """Each stacked prompt tensor reaches the device in one copy (rows are views), and every row
    is trimmed to its own length as the engine padded it; a row with an all-False mask keeps the
    full width."""
    from flowrl.trainer.policy import _encodings

    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    embeds = torch.arange(4 * 4 * 2, dtype=torch.float32).reshape(4, 4, 2)
    pooled = torch.randn(4, 3)
    tensors = {
        "prompt_embeds": embeds.as_subclass(_CountingTensor),
        "prompt_embeds_mask": mask.as_subclass(_CountingTensor),
        "pooled_prompt_embeds": pooled.as_subclass(_CountingTensor),
    }
    _CountingTensor.to_calls = 0
    encodings = _encodings(tensors, "", "cpu")
    assert _CountingTensor.to_calls == 3  # embeds, mask, pooled: not one copy per row
    assert [e.embeds.shape[0] for e in encodings] == [3, 1, 4, 4]
    for row, e in enumerate(encodings):
        assert torch.equal(e.embeds, embeds[row, : e.embeds.shape[0]]) and torch.equal(e.pooled, pooled[row])
        assert torch.equal(e.mask, mask[row, : e.embeds.shape[0]])


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_recompute_values_stand_in_for_the_value_pass_until_the_first_update(
    make_cfg, take_rollout, monkeypatch, kl_beta
):
    """Compiled, old_log_prob=recompute, one optimizer step per training step: the recompute ran
    the no-grad graph on the same micro-batches with the same weights, so the grad passes take its
    values and no second no-grad forward runs; the update is the one the value pass gives. With a
    KL term the mean's value is needed, so the value pass runs."""
    from flowrl.models.sd3 import SD3Adapter
    from flowrl.trainer.update import Scoring

    monkeypatch.setattr(flowrl.accel, "compile_adapter", lambda adapter, backend="inductor", rounding="eager": [])
    monkeypatch.setattr(flowrl.accel, "is_compiled", lambda adapter: True)

    def run(force_value_pass: bool):
        trainer = FlowGRPOTrainer(
            make_cfg(
                "rollout.n=2",
                "trainer.prompts_per_step=2",
                "trainer.micro_batch_size=2",
                "algorithm.old_log_prob=recompute",
                "trainer.lora.enabled=true",
                f"algorithm.kl_beta={kl_beta}",
                "engine.compile=true",
                output=f"run-{force_value_pass}",
            )
        )
        with torch.no_grad():  # a policy away from the reference, so the KL has a gradient
            for name, p in trainer.adapter.transformer.named_parameters():
                if "lora_B" in name:
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        tensors, specs = take_rollout(trainer)
        calls = {"no_grad": 0}
        velocity = SD3Adapter.velocity

        def counted(self, *args, **kwargs):
            calls["no_grad"] += not torch.is_grad_enabled()
            return velocity(self, *args, **kwargs)

        # The strategy is chosen once: the recompute's values before the first optimizer step
        # (no KL term), the value pass everywhere else.
        reuses = kl_beta == 0
        assert trainer.updater.scoring == Scoring("recompute" if reuses else "value_pass", "value_pass")
        if force_value_pass:
            trainer.updater.scoring = Scoring("value_pass", "value_pass")
        with monkeypatch.context() as patch:
            patch.setattr(SD3Adapter, "velocity", counted)
            metrics = trainer.updater.update(
                tensors, specs, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4), step=1
            )
        return metrics, calls["no_grad"], tensors["sigmas"].shape[1]

    metrics, no_grad_forwards, window = run(False)
    forced, forced_no_grad_forwards, _ = run(True)
    scored = 2 * window  # 2 micro-batches x every window step
    assert forced_no_grad_forwards == scored * (2 if kl_beta == 0 else 3)  # recompute + value pass (+ KL reference)
    assert no_grad_forwards == (scored if kl_beta == 0 else forced_no_grad_forwards)
    assert metrics["actor/ratio_max"] == 1.0 and metrics["actor/grad_norm"] > 0.0
    assert metrics["actor/grad_norm"] == forced["actor/grad_norm"]


@pytest.mark.parametrize(
    "values_from_no_grad, old_log_prob, kl_beta, expected",
    [
        (False, "recompute", 0.0, ("grad_pass", "grad_pass")),  # eager: one graph, its own values
        (True, "rollout", 0.0, ("value_pass", "value_pass")),  # no recompute to reuse
        (True, "recompute", 0.0, ("recompute", "value_pass")),  # reused until the first optimizer step
        (True, "recompute", 0.1, ("value_pass", "value_pass")),  # the KL needs the mean's value too
    ],
)
def test_scoring_is_chosen_once_from_the_settings(values_from_no_grad, old_log_prob, kl_beta, expected):
    from flowrl.trainer.update import Scoring

    assert Scoring.choose(values_from_no_grad, old_log_prob, kl_beta) == Scoring(*expected)
