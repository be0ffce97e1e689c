"""Optimizer steps per rollout batch (`trainer.updates_per_step`) and the weight of each trained
(sample, step) pair: checked against direct computations of the PPO objective."""

from types import SimpleNamespace

import torch

from flowrl.trainer.logprob import score_transitions

CLIP = 1e-4


def _log_probs(trainer, tensors, specs, rows, train_steps, grad=False):
    """(len(rows), K) log-probs of `rows` in ONE forward per trained step, current weights."""
    mb = {name: t[rows] for name, t in tensors.items()}
    row_specs = [specs[i] for i in rows.tolist()]
    with torch.set_grad_enabled(grad):
        return torch.stack(
            [
                score_transitions(trainer.adapter, mb, train_steps[rows, k], row_specs).log_prob
                for k in range(train_steps.shape[1])
            ],
            dim=1,
        )


def _objective(log_prob, old, advantages):
    """Per-pair clipped PPO objective (rows, K)."""
    ratio = torch.exp(log_prob - old)
    adv = advantages[:, None]
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)), ratio


def _capture_optimizer_steps(trainer, monkeypatch, on_step):
    """Call on_step(index) right before each optimizer step of the updater (the gradients are
    those of the mini-batch just scored, the weights those it was scored with)."""
    updater = trainer.algorithm.updater
    original = updater._optimizer_step
    calls = []

    def wrapped():
        on_step(len(calls))
        calls.append(1)
        return original()

    monkeypatch.setattr(updater, "_optimizer_step", wrapped)


def test_two_updates_per_batch_clip_in_the_second_and_optimize_its_mini_batch_mean(
    build_trainer, make_cfg, take_rollout, monkeypatch
):
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=4",
            "trainer.updates_per_step=2",
            "trainer.micro_batch_size=4",  # a mini-batch of 4 samples is one micro-batch
            "algorithm.old_log_prob=recompute",
            f"algorithm.clip_range={CLIP}",
        )
    )
    tensors, specs = take_rollout(trainer)
    advantages = torch.linspace(-1.5, 1.5, 8)
    plan = trainer.algorithm.updater.plan(tensors, specs, step=1)
    mini_batches = [torch.cat(step) for step in plan.optimizer_steps]
    assert [len(rows) for rows in mini_batches] == [4, 4]
    assert sorted(torch.cat(mini_batches).tolist()) == list(range(8))
    # The denominator as the updater recomputes it: the first weights, the same forwards.
    old = {i: _log_probs(trainer, tensors, specs, rows, plan.train_steps) for i, rows in enumerate(mini_batches)}
    direct = {}

    def on_step(index):
        rows = mini_batches[index]
        log_prob = _log_probs(trainer, tensors, specs, rows, plan.train_steps)
        objective, ratio = _objective(log_prob, old[index], advantages[rows])
        direct[index] = (float(objective.mean()), float(((ratio - 1).abs() > CLIP).float().mean()))

    _capture_optimizer_steps(trainer, monkeypatch, on_step)
    metrics = trainer.algorithm.updater.prepare_and_update(tensors, specs, advantages, torch.ones(8), step=1)
    first, second = trainer.algorithm.updater.records
    assert metrics["actor/num_optimizer_steps"] == 2
    assert first.clipfrac == 0.0 and direct[0][1] == 0.0  # on-policy: ratio exactly 1
    assert second.clipfrac > 0.0  # one update later the ratios moved past the clip range
    for index, record in enumerate((first, second)):
        assert torch.equal(record.rows, mini_batches[index])
        assert abs(record.loss - direct[index][0]) < 1e-6, (index, record.loss, direct[index])
        assert record.clipfrac == direct[index][1]


def test_uneven_micro_batches_give_the_single_pass_mean_over_valid_pairs(
    build_trainer, make_cfg, take_rollout, monkeypatch
):
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=3",
            "trainer.micro_batch_size=4",  # 6 rows: micro-batches of 4 and 2
            "algorithm.old_log_prob=recompute",
            "algorithm.train_timestep_fraction=0.5",
        )
    )
    tensors, specs = take_rollout(trainer)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # row 2 excluded
    plan = trainer.algorithm.updater.plan(tensors, specs, step=1)
    [micro_batches] = plan.optimizer_steps
    assert sorted(len(rows) for rows in micro_batches) == [2, 4]
    params = trainer.algorithm.updater.params
    grads = {}

    def on_step(index):
        grads["update"] = [p.grad.clone() for p in params]

    _capture_optimizer_steps(trainer, monkeypatch, on_step)
    old = _log_probs(trainer, tensors, specs, torch.arange(6), plan.train_steps)
    first_weights = [p.detach().clone() for p in params]
    trainer.algorithm.updater.prepare_and_update(tensors, specs, advantages, weights, step=1)
    # The update moved the weights: take them back and compute the single pass at the first weights.
    # (Ratios are 1 up to batch-shape rounding, far inside the clip range, so no pair is clipped.)
    with torch.no_grad():
        for p, saved in zip(params, first_weights):
            p.copy_(saved)
    valid = weights > 0
    log_prob = _log_probs(trainer, tensors, specs, torch.arange(6), plan.train_steps, grad=True)
    objective, _ = _objective(log_prob, old, advantages)
    for p in params:
        p.grad = None
    objective[valid].mean().backward()
    for got, want in zip(grads["update"], [p.grad for p in params]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-8)


def _update_with(build_trainer, make_cfg, take_rollout, monkeypatch, *overrides) -> SimpleNamespace:
    """One update of 6 rows (two mini-batches of 3, micro-batches of 2), recording the rows of
    every grad forward and each optimizer step's accumulated gradients."""
    trainer = build_trainer(
        make_cfg(
            "rollout.n=2",
            "trainer.prompts_per_step=3",
            "trainer.micro_batch_size=2",
            "trainer.updates_per_step=2",
            f"algorithm.clip_range={CLIP}",
            *overrides,
        )
    )
    tensors, specs = take_rollout(trainer)
    run = SimpleNamespace(trainer=trainer, forwards=[], grads=[], window=tensors["sigmas"].shape[1])
    original = trainer.algorithm.updater.score_with_grad

    def counted(tensors_, forward, values):
        run.forwards.append(len(forward.rows))
        return original(tensors_, forward, values)

    monkeypatch.setattr(trainer.algorithm.updater, "score_with_grad", counted)
    _capture_optimizer_steps(
        trainer, monkeypatch, lambda index: run.grads.append([p.grad.clone() for p in trainer.algorithm.updater.params])
    )
    plan = trainer.algorithm.updater.plan(tensors, specs, step=1)
    run.sizes = [len(rows) for micro_batches in plan.optimizer_steps for rows in micro_batches]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    run.metrics = trainer.algorithm.updater.prepare_and_update(tensors, specs, advantages, weights, step=1)
    return run
