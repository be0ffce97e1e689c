"""Rollout/trainer agreement on real tiny-SD3 rollouts: the trainer re-scores stored transitions
with the engine's own sampler function (CFG included), so on CPU float32 the log-probs agree."""

import numpy as np
import pytest
import torch

import flowrl.accel
from flowrl.trainer.logprob import takes_values_from_no_grad


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_rollout_log_probs_match_trainer_recompute(build_trainer, make_cfg, take_rollout, guidance):
    cfg = make_cfg(
        "rollout.n=3",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4",
        "algorithm.old_log_prob=recompute",
        f"rollout.sampling.guidance_scale={guidance}",
        "rollout.sampling.negative_prompt=blurry",
    )
    trainer = build_trainer(cfg)
    tensors, specs = take_rollout(trainer)
    if guidance > 1:
        assert "negative_prompt_embeds" in tensors
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    metrics = trainer.algorithm.updater.prepare_and_update(tensors, specs, advantages, torch.ones(6), step=1)
    # CPU float32: the same function on the same inputs, only the batch composition differs.
    assert metrics["actor/logprob_gap_max"] < 1e-5
    # First update on fresh rollouts with a recomputed denominator: ratio exactly 1, no clipping.
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_max"] == 1.0
    assert metrics["actor/clipfrac"] == 0.0
    assert metrics["actor/grad_norm"] > 0.0


def test_log_prob_parity_holds_with_mixgrpo_flashs_tail(build_trainer, make_cfg, take_rollout):
    """MixGRPO-Flash: a progressive window of 2, DPM-Solver++(2M) on a compressed ODE tail. The
    tail is neither stored nor scored, so the trainer re-scores the window steps as they were drawn."""
    cfg = make_cfg(
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4",
        "algorithm.old_log_prob=recompute",
        "rollout.sampling.sde_window_size=2",
        "rollout.sde_window_draw=progressive",
        "rollout.sampling.ode_solver=dpmpp_2m",
        "rollout.sampling.ode_tail_ratio=0.4",
    )
    trainer = build_trainer(cfg)
    tensors, specs = take_rollout(trainer)
    assert tensors["all_log_probs"].shape == (4, 2)
    metrics = trainer.algorithm.updater.prepare_and_update(
        tensors, specs, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4), step=1
    )
    assert metrics["actor/logprob_gap_max"] < 1e-5
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/clipfrac"] == 0.0


def test_the_config_names_a_bad_solver_setting(make_cfg):
    with pytest.raises(
        ValueError, match=r"rollout\.sampling\.ode_solver='dpm' is invalid: use one of 'euler', 'dpmpp_2m'"
    ):
        make_cfg("rollout.sampling.ode_solver=dpm")
    with pytest.raises(ValueError, match=r"rollout\.val_sampling\.ode_tail_ratio=0\.4 .*use fewer num_inference_steps"):
        make_cfg("rollout.val_sampling.ode_tail_ratio=0.4")


def test_rollout_denominator_gap_and_updates_change_the_policy(build_trainer, make_cfg, take_rollout):
    cfg = make_cfg(
        "rollout.n=2",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=2",
        "trainer.updates_per_step=2",
        "algorithm.old_log_prob=rollout",
        "trainer.lr=0.05",
        "algorithm.clip_range=1e-6",
    )
    trainer = build_trainer(cfg)
    tensors, specs = take_rollout(trainer)
    metrics = trainer.algorithm.updater.prepare_and_update(
        tensors, specs, torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones(4), step=1
    )
    assert metrics["actor/logprob_gap_max"] < 1e-5  # measured before the first optimizer step
    assert metrics["actor/num_optimizer_steps"] == 2
    # The second micro-batch is scored after one update: its ratio moved, and the tiny clip caught it.
    assert metrics["actor/ratio_max"] != 1.0 or metrics["actor/ratio_mean"] != 1.0
    assert metrics["actor/clipfrac"] > 0.0


def test_kl_reference_is_the_lora_disabled_model(build_trainer, make_cfg, take_rollout):
    cfg = make_cfg(
        "rollout.n=2",
        "trainer.prompts_per_step=1",
        "algorithm.kl_beta=0.1",
        "trainer.lora.enabled=true",
        "algorithm.old_log_prob=recompute",
    )
    trainer = build_trainer(cfg)
    tensors, specs = take_rollout(trainer)
    adv = torch.tensor([1.0, -1.0])
    # LoRA B starts at zero: the policy IS the reference, so the KL is exactly 0.
    first = trainer.algorithm.updater.prepare_and_update(tensors, specs, adv, torch.ones(2), step=1)
    assert first["actor/kl"] == 0.0
    with torch.no_grad():
        for name, p in trainer.adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    second = trainer.algorithm.updater.prepare_and_update(tensors, specs, adv, torch.ones(2), step=2)
    assert second["actor/kl"] > 0.0 and np.isfinite(second["actor/kl"])


def _grad_graph_rounds_differently(monkeypatch, adapter_cls, offset=1e-3):
    """Make the model's grad-mode forward differ from its no-grad forward by `offset`, as a
    compiled model's two graphs may round differently (docs/performance.md)."""
    velocity = adapter_cls.velocity

    def perturbed(self, *args, **kwargs):
        out = velocity(self, *args, **kwargs)
        return out + offset if torch.is_grad_enabled() else out

    monkeypatch.setattr(adapter_cls, "velocity", perturbed)


def test_values_from_no_grad_are_the_no_grad_values_with_the_grad_gradients(
    build_trainer, make_cfg, take_rollout, monkeypatch
):
    from flowrl.models.sd3 import SD3Adapter
    from flowrl.trainer.logprob import score_transitions

    trainer = build_trainer(make_cfg("rollout.n=2", "trainer.prompts_per_step=1", "trainer.lora.enabled=true"))
    tensors, specs = take_rollout(trainer)
    adapter, params = trainer.adapter, trainer.algorithm.updater.params
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


def _unchanged_weights_update(trainer, tensors, specs, num_rows: int) -> dict:
    """An update whose optimizer steps leave the weights as they are (learning rate 0; zero
    advantages too): every ratio of it must be exactly 1, whatever step it is in. A KL term's
    gradient need not be zero at these weights (its reference is another graph)."""
    trainer.algorithm.updater.optimizer.param_groups[0]["lr"] = 0.0
    return trainer.algorithm.updater.prepare_and_update(
        tensors, specs, torch.zeros(num_rows), torch.ones(num_rows), step=1
    )


def _pretend_compiled(monkeypatch, compiled: bool) -> None:
    """engine.compile=true without compiling: the trainer then sees a model that `compiled` says
    is compiled (or not)."""
    monkeypatch.setattr(flowrl.accel, "compile_adapter", lambda adapter, backend="inductor": [])
    monkeypatch.setattr(flowrl.accel, "is_compiled", lambda adapter: compiled)


def _two_step_recompute_trainer(build_trainer, make_cfg, monkeypatch, compiled: bool, kl_beta: float, *overrides: str):
    """A LoRA trainer over 2 prompts x 2 samples, old_log_prob=recompute, two optimizer steps of
    one 2-row micro-batch each, a tiny clip range; `compiled` pretends engine.compile compiled it."""
    _pretend_compiled(monkeypatch, compiled)
    return build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=2",
            "trainer.micro_batch_size=2",
            "trainer.updates_per_step=2",
            "trainer.lora.enabled=true",
            "algorithm.old_log_prob=recompute",
            f"algorithm.kl_beta={kl_beta}",
            "algorithm.clip_range=1e-6",
            f"engine.compile={str(compiled).lower()}",
            *overrides,
        )
    )


@pytest.mark.parametrize(
    "kl_beta, scoring",
    [
        (0.0, None),  # chosen: grad-pass values, the recompute run with grad
        (0.1, None),  # chosen: the same, with the KL term (its reference a no-grad forward)
        (0.0, ("grad_pass", False)),  # forced mismatch: the check must see it
    ],
)
def test_compiled_trainer_scores_the_denominator_in_the_graph_of_its_values(
    build_trainer, make_cfg, take_rollout, monkeypatch, kl_beta, scoring
):
    """A compiled model's grad graph may round differently from its no-grad graph: the recompute
    of the later optimizer steps' denominators runs in the graph the update's values come from,
    so with unchanged weights their ratios are exactly 1 (a recompute in the other graph moves
    them, and a tiny clip range catches it)."""
    from flowrl.models.sd3 import SD3Adapter
    from flowrl.trainer.logprob import Scoring

    trainer = _two_step_recompute_trainer(build_trainer, make_cfg, monkeypatch, True, kl_beta)
    assert (
        trainer.algorithm.updater.scoring.values == "value_pass"
        or trainer.algorithm.updater.scoring.recompute_with_grad
    )
    if scoring is not None:
        trainer.algorithm.updater.scoring = Scoring(*scoring)
    tensors, specs = take_rollout(trainer)
    _grad_graph_rounds_differently(monkeypatch, SD3Adapter)
    metrics = _unchanged_weights_update(trainer, tensors, specs, 4)
    records = trainer.algorithm.updater.records
    assert len(records) == 2 and records[0].clipfrac == 0.0  # the first step's own values
    if scoring is None:
        assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_max"] == 1.0
        assert metrics["actor/clipfrac"] == 0.0
    else:
        assert records[1].clipfrac > 0.0 and metrics["actor/ratio_mean"] != 1.0


@pytest.mark.parametrize("compiled, kl_beta", [(False, 0.0), (True, 0.0), (True, 0.1)])
def test_the_recompute_scores_only_the_rows_after_the_first_optimizer_step(
    build_trainer, make_cfg, take_rollout, monkeypatch, compiled, kl_beta
):
    """old_log_prob=recompute over two optimizer steps: the first step's rows take their
    denominators from its own passes (its ratios exactly 1, nothing clipped, even with a tiny clip
    range), so the recompute scores only the second step's rows, in the graph of the update's
    values: without grad for one graph (eager), with grad for a compiled model, with a KL term
    or without (grad-pass values, no value pass; the KL's reference is a no-grad forward)."""
    from flowrl.models.sd3 import SD3Adapter
    from flowrl.trainer.logprob import Scoring

    trainer = _two_step_recompute_trainer(build_trainer, make_cfg, monkeypatch, compiled, kl_beta, "trainer.lr=0.05")
    expected = {
        (False, 0.0): Scoring("grad_pass"),
        (True, 0.0): Scoring("grad_pass", recompute_with_grad=True),
        (True, 0.1): Scoring("grad_pass", recompute_with_grad=True),
    }[compiled, kl_beta]
    assert trainer.algorithm.updater.scoring == expected
    with torch.no_grad():  # a policy away from the reference, so the KL has a gradient
        for name, p in trainer.adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    tensors, specs = take_rollout(trainer)
    calls = {True: 0, False: 0}
    velocity = SD3Adapter.velocity

    def counted(self, *args, **kwargs):
        calls[torch.is_grad_enabled()] += 1
        return velocity(self, *args, **kwargs)

    monkeypatch.setattr(SD3Adapter, "velocity", counted)
    metrics = trainer.algorithm.updater.prepare_and_update(
        tensors, specs, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4), step=1
    )
    window = tensors["sigmas"].shape[1]  # one micro-batch per optimizer step, every window step trained
    recompute, grad_passes = window, 2 * window
    value_passes = grad_passes if expected.values == "value_pass" else 0
    references = grad_passes if kl_beta > 0 else 0
    with_grad_recompute = recompute if expected.recompute_with_grad else 0
    assert calls[True] == grad_passes + with_grad_recompute
    assert calls[False] == recompute - with_grad_recompute + value_passes + references
    first, second = trainer.algorithm.updater.records
    assert first.clipfrac == 0.0 and second.clipfrac > 0.0  # the second step's ratios moved with the weights
    assert metrics["actor/grad_norm"] > 0.0 and metrics["actor/logprob_gap_max"] < 1e-5


def test_later_epochs_compare_with_the_first_steps_own_values(build_trainer, make_cfg, take_rollout):
    """With two update epochs the rows of epoch 0's first optimizer step keep the denominators
    that step scored: unchanged weights and one row per forward (the same batch composition in
    both epochs) give ratios of exactly 1 in every step."""
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=2",
            "trainer.micro_batch_size=1",
            "trainer.updates_per_step=2",
            "trainer.update_epochs=2",
            "algorithm.old_log_prob=recompute",
            "algorithm.clip_range=1e-6",
        )
    )
    tensors, specs = take_rollout(trainer)
    metrics = _unchanged_weights_update(trainer, tensors, specs, 4)
    assert metrics["actor/num_optimizer_steps"] == 4
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_max"] == 1.0
    assert metrics["actor/clipfrac"] == 0.0


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_dropout_keeps_the_grad_pass_values(build_trainer, make_cfg, monkeypatch, dropout):
    """With LoRA dropout the train-mode forward is random: a value pass would draw one dropout mask
    and the grad pass another, so a compiled trainer then keeps the grad pass's own values (and
    the recompute's values are not reused for it either)."""
    _pretend_compiled(monkeypatch, True)
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=1",
            "trainer.lora.enabled=true",
            f"trainer.lora.dropout={dropout}",
            "engine.compile=true",
        )
    )
    assert takes_values_from_no_grad(trainer.adapter) is (dropout == 0.0)
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
    from flowrl.trainer.velocity import prompt_encodings

    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    embeds = torch.arange(4 * 4 * 2, dtype=torch.float32).reshape(4, 4, 2)
    pooled = torch.randn(4, 3)
    tensors = {
        "prompt_embeds": embeds.as_subclass(_CountingTensor),
        "prompt_embeds_mask": mask.as_subclass(_CountingTensor),
        "pooled_prompt_embeds": pooled.as_subclass(_CountingTensor),
    }
    _CountingTensor.to_calls = 0
    encodings = prompt_encodings(tensors, "", "cpu")
    assert _CountingTensor.to_calls == 3  # embeds, mask, pooled: not one copy per row
    assert [e.embeds.shape[0] for e in encodings] == [3, 1, 4, 4]
    for row, e in enumerate(encodings):
        assert torch.equal(e.embeds, embeds[row, : e.embeds.shape[0]]) and torch.equal(e.pooled, pooled[row])
        assert torch.equal(e.mask, mask[row, : e.embeds.shape[0]])


@pytest.mark.parametrize(
    "values_from_no_grad, old_log_prob, kl_beta, expected",
    [
        (False, "recompute", 0.0, ("grad_pass", False)),  # eager: one graph, its own values
        (False, "rollout", 0.0, ("grad_pass", False)),
        (True, "rollout", 0.0, ("value_pass", False)),  # the rollout's log-probs are the denominator
        (True, "recompute", 0.0, ("grad_pass", True)),  # the grad graph against itself: no value pass
        (True, "recompute", 0.1, ("grad_pass", True)),  # the KL's reference is another graph anyway
    ],
)
def test_scoring_is_chosen_once_from_the_settings(
    build_trainer, make_cfg, monkeypatch, values_from_no_grad, old_log_prob, kl_beta, expected
):
    from flowrl.trainer.logprob import Scoring

    _pretend_compiled(monkeypatch, values_from_no_grad)
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=1",
            "trainer.lora.enabled=true",
            f"algorithm.old_log_prob={old_log_prob}",
            f"algorithm.kl_beta={kl_beta}",
            f"engine.compile={str(values_from_no_grad).lower()}",
        )
    )
    assert trainer.algorithm.updater.scoring == Scoring(*expected)  # the trainer's choice, from its config
