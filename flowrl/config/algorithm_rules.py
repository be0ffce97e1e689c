"""Which settings apply to which algorithm: `check_algorithm(cfg)` (part of the config's validation)
refuses a setting of one algorithm given to another (a non-default value: it would be accepted
and ignored), `check_training_rollout(cfg)` (before a training run loads its model) a training
rollout the chosen algorithm cannot train on, `check_trained_steps(cfg, steps)` (once the model is
loaded, from its schedule) rollouts whose trained steps the trained module does not predict
(Wan2.2-A14B's other expert).

FlowGRPO trains on the SDE transitions of its rollouts (their log-probs are its ratio's
denominators); DiffusionNFT trains on the final latents of deterministic rollouts through the
forward process, so the SDE settings are not its. Each rule names the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses

GROUP_ADVANTAGES = ("flow_grpo", "diffusion_nft", "awm")

# Settings of some algorithms alone: algorithm.<field> -> the algorithms it applies to.
OWN_SETTINGS = {
    "clip_range": ("flow_grpo", "awm"),
    "old_log_prob": ("flow_grpo",),
    "behaviour_weight_cap": ("flow_grpo",),
    "policy_loss": ("flow_grpo",),
    "dppo_tau": ("flow_grpo",),
    "kl_type": ("flow_grpo",),
    "advantage_aggregation": GROUP_ADVANTAGES,
    # The group-relative advantages and the KL to the reference (online DPO uses neither: its pairs
    # are each group's best and worst sample, its loss already compares with a reference).
    "std_mode": GROUP_ADVANTAGES,
    "std_eps": GROUP_ADVANTAGES,
    "adv_clip_max": GROUP_ADVANTAGES,
    "zero_std_policy": GROUP_ADVANTAGES,
    "zero_std_threshold": GROUP_ADVANTAGES,
    "kl_beta": GROUP_ADVANTAGES,
    "nft": ("diffusion_nft",),
    "awm": ("awm",),
    "dpo": ("online_dpo",),
}

# Algorithms that train on the final latents of deterministic rollouts.
FORWARD_PROCESS = ("diffusion_nft", "awm", "online_dpo")


def check_algorithm(cfg) -> None:
    """Raise ValueError for a setting that does not apply to cfg.algorithm.name (module docstring)."""
    algorithm, name = cfg.algorithm, cfg.algorithm.name
    defaults = type(algorithm)()
    for field, owners in OWN_SETTINGS.items():
        if name in owners:
            continue
        for key, value, default in _values(f"algorithm.{field}", getattr(algorithm, field), getattr(defaults, field)):
            if value != default:
                raise ValueError(
                    f"{key}={value!r} is a setting of algorithm.name={' or '.join(owners)}, and this run trains "
                    f"{name}; remove it (or set algorithm.name={owners[0]})"
                )
    if name == "online_dpo" and algorithm.dpo.ref_update_every == 0 and not cfg.trainer.lora.enabled:
        raise ValueError(
            "algorithm.dpo.ref_update_every=0 takes the LoRA-disabled model as the reference, and "
            "trainer.lora.enabled=false trains no adapter; set algorithm.dpo.ref_update_every=K > 0 (a "
            "snapshot of the trained weights every K steps, e.g. 40) or trainer.lora.enabled=true"
        )


def _values(key: str, value, default):
    """(key, value, default) of a setting, or of each field of a section of settings."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _values(f"{key}.{f.name}", getattr(value, f.name), getattr(default, f.name))
    else:
        yield key, value, default


def check_training_rollout(cfg) -> None:
    """Raise ValueError for training rollouts the algorithm cannot train on (checked before a
    training run loads its model; other commands may sample as they like)."""
    if cfg.algorithm.name in FORWARD_PROCESS:
        _check_deterministic_rollout(cfg.rollout, cfg.algorithm.name)
    else:
        _check_sde_rollout(cfg.rollout, cfg.algorithm)


def _check_sde_rollout(rollout, algorithm) -> None:
    """FlowGRPO's rollouts: SDE steps to train, whose log-probs exist where the ratio takes them."""
    s = rollout.sampling
    if not s.logprobs and algorithm.old_log_prob == "rollout":
        raise ValueError(
            "rollout.sampling.logprobs=false with algorithm.old_log_prob=rollout: there is no "
            "rollout log-prob to use; set logprobs=true or old_log_prob=recompute"
        )
    if s.noise_level <= 0:
        raise ValueError(
            f"rollout.sampling.noise_level={s.noise_level}: {algorithm.name} trains on stochastic (SDE) "
            "rollouts; use e.g. 0.7 (or algorithm.name=diffusion_nft, which trains on deterministic ones)"
        )
    if s.num_inference_steps < 2:
        raise ValueError(
            f"rollout.sampling.num_inference_steps={s.num_inference_steps} leaves no "
            "SDE step to train (the last step, which ends at sigma 0, is always an ODE step); use >= 2, e.g. 10"
        )


def _check_deterministic_rollout(rollout, name: str) -> None:
    """A forward-process algorithm's rollouts: a deterministic solver, no log-probs, no window."""
    s = rollout.sampling
    wrong = [
        ("noise_level", s.noise_level, s.noise_level != 0.0, "0.0 (flowrl's deterministic solver, Euler's ODE step)"),
        ("logprobs", s.logprobs, s.logprobs, "false (nothing scores the rollout's steps)"),
        ("sde_window", s.sde_window, s.sde_window is not None, "null (the rollout keeps its final latent alone)"),
        ("sde_window_size", s.sde_window_size, s.sde_window_size is not None, "null"),
    ]
    for field, value, is_wrong, fix in wrong:
        if is_wrong:
            raise ValueError(
                f"rollout.sampling.{field}={value!r}: algorithm.name={name} trains on the final images of "
                f"deterministic rollouts; set rollout.sampling.{field}={fix}"
            )


def check_trained_steps(cfg, steps: list[int]) -> None:
    """Raise ValueError when the rollouts would train steps the trained module does not predict.

    `steps`: the indices, among the T steps of rollout.sampling's schedule, that it predicts (a
    run of consecutive indices; all T but for a two-expert model, whose model.trained_expert
    predicts one side of its boundary). FlowGRPO trains its SDE window steps, so every step a
    window may take must be one of them; a forward-process algorithm trains the schedule's
    timesteps the expert predicts (flowrl.trainer.forward_process), so it needs one."""
    s, expert = cfg.rollout.sampling, cfg.model.trained_expert
    num_steps = s.num_inference_steps
    if len(steps) == num_steps:
        return
    predicts = f"the {expert} expert (model.trained_expert={expert}) predicts " + (
        f"steps {steps[0]}..{steps[-1]} of {num_steps}" if steps else f"none of the {num_steps} steps"
    )
    if cfg.algorithm.name in FORWARD_PROCESS:
        if not steps:
            raise ValueError(
                f"{predicts} of rollout.sampling.num_inference_steps={num_steps}, so no timestep trains; "
                "use more steps (or train the other expert)"
            )
        return
    lo, hi = steps[0], min(steps[-1] + 1, num_steps - 1)  # the last step, to sigma 0, is always ODE
    if lo >= hi:
        raise ValueError(
            f"{predicts} with rollout.sampling.num_inference_steps={num_steps}, none an SDE step (the last step "
            "is always an ODE step); use more rollout.sampling.num_inference_steps"
        )
    if s.sde_window is not None:
        start, end = s.sde_window
        setting = f"rollout.sampling.sde_window={list(s.sde_window)}"
    elif s.sde_window_size is not None:
        start, end = s.sde_window_range or (0, num_steps - 1)
        setting = (
            f"rollout.sampling.sde_window_size={s.sde_window_size} with "
            f"rollout.sampling.sde_window_range={None if s.sde_window_range is None else list(s.sde_window_range)}"
        )
    else:
        start, end = 0, num_steps - 1
        setting = "rollout.sampling.sde_window=null and sde_window_size=null (every step but the last)"
    if lo <= start and end <= hi:
        return
    raise ValueError(
        f"{setting} lets the SDE window take steps {start}..{end - 1}, but {predicts}: a step of the other, "
        f"frozen expert would train nothing; set rollout.sampling.sde_window=[{lo}, {hi}] (steps {lo}..{hi - 1}, "
        f"or a window inside them), or rollout.sampling.sde_window_range=[{lo}, {hi}] with "
        f"sde_window_size <= {hi - lo}"
    )
