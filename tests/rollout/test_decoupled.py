"""Decoupled training: rollouts on `flowrl serve` replicas (rollout.servers), weights pushed after
each update. After every sync both replicas serve exactly the trainer's weights (checksum), and the
run's metrics match the colocated run of the same seeds; one-step-ahead async training
(trainer.async_rollout) has every sample one update (two optimizer steps here) stale after the
first step and trains it with decoupled PPO: the clip centred on the update's starting weights
(first optimizer step's ratio exactly 1), the rollout's log-probs entering as behaviour weights."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch

from flowrl.models.lora import trainable_state_dict
from flowrl.run.interrupts import TrainingInterrupted
from flowrl.server import wire

TOKEN = "test-admin-token"
# A small LoRA run: 2 prompts x 4 samples per step.
RUN = ("trainer.lora.enabled=true", "trainer.prompts_per_step=2", "rollout.n=4", "trainer.lr=0.01")
ASYNC = ("trainer.async_rollout=true", "algorithm.old_log_prob=recompute")
COMPARED = ("reward/mean", "reward/std", "actor/policy_loss", "actor/ratio_mean", "actor/grad_norm")


def servers_override(urls) -> str:
    return "rollout.servers=[" + ",".join(urls) + "]"


def record_syncs(trainer) -> list[dict]:
    """After every publish: the trainer's weights checksum and what each live replica serves."""
    records = []
    publish = trainer.rollout_backend.publish

    def recording(version):
        publish(version)
        records.append(
            {
                "version": version,
                "trainer": wire.weights_sha256(trainable_state_dict(trainer.adapter.transformer)),
                "replicas": [c.weights_info() for c in trainer.rollout_backend.balancer.live_replicas],
            }
        )

    trainer.rollout_backend.publish = recording
    trainer.rollouts.backend = trainer.rollout_backend
    return records


def run_steps(trainer, num_steps):
    metrics = [trainer.train_step() for _ in range(num_steps)]
    trainer.rollouts.finish()
    return metrics


def test_two_replicas_serve_the_trainers_weights_and_match_the_colocated_run(
    make_cfg, rollout_servers, tiny_sd3_path, monkeypatch, check_loopback_only, build_trainer
):
    monkeypatch.setenv(wire.ADMIN_TOKEN_ENV, TOKEN)
    urls = rollout_servers(tiny_sd3_path, count=2, admin_token=TOKEN)
    decoupled = build_trainer(make_cfg(*RUN, servers_override(urls), output="decoupled"))
    syncs = record_syncs(decoupled)
    remote_metrics = run_steps(decoupled, 2)
    check_loopback_only()
    colocated = build_trainer(make_cfg(*RUN, output="colocated"))
    local_metrics = run_steps(colocated, 2)

    # 1. after each sync (after each update), both replicas serve the trainer's weights exactly
    assert [s["version"] for s in syncs] == [1, 2]
    for sync in syncs:
        assert len(sync["replicas"]) == 2
        for info in sync["replicas"]:
            assert (info["policy_version"], info["weights_sha256"]) == (sync["version"], sync["trainer"])
    # 2. both replicas took groups (a group stays on one), and the metrics are the colocated run's
    assert all(count > 0 for count in decoupled.agent_loop.balancer.assigned)
    for remote, local in zip(remote_metrics, local_metrics):
        assert remote["rollout/staleness_max"] == 0 and remote["rollout/policy_lag"] == 0
        for key in COMPARED:
            assert remote[key] == pytest.approx(local[key], rel=1e-4, abs=1e-6), key
    for (name, a), b in zip(
        trainable_state_dict(decoupled.adapter.transformer).items(), colocated.algorithm.updater.params
    ):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=0, msg=name)
    decoupled.rollout_backend.close()


def test_async_training_is_one_update_stale_and_off_policy(
    make_cfg, rollout_servers, tiny_sd3_path, monkeypatch, build_trainer
):
    monkeypatch.setenv(wire.ADMIN_TOKEN_ENV, TOKEN)
    urls = rollout_servers(tiny_sd3_path, count=2, admin_token=TOKEN)
    cfg = make_cfg(
        *RUN, servers_override(urls), *ASYNC, "trainer.updates_per_step=2", "trainer.total_steps=3", output="async"
    )
    trainer = build_trainer(cfg)
    syncs = record_syncs(trainer)
    seen = []
    roll_out = trainer.samples.roll_out

    def recording(step):
        result = roll_out(step)
        seen.append((step, sorted(set(result.batch.non_tensor_batch["policy_version"]))))
        return result

    trainer.rollouts.roll_out = recording
    metrics = [trainer.train_step(), trainer.train_step()]
    # A checkpoint now (step 3's rollout is out) saves the data position after step 2's rows.
    state = json.loads((trainer.save() / "state.json").read_text())["trainer"]
    assert state["rows_generated"] == 2 * 8 and state["data"]["position"] == 4
    metrics += run_steps(trainer, 1)

    # Versions count optimizer steps (two per update). Step 1 rolls out with version 0; step 2's
    # rollout ran during step 1's update, still on version 0; step 3's on version 2 (published once
    # step 2's rollout had returned).
    assert sorted(seen) == [(1, [0]), (2, [0]), (3, [2])]
    # Staleness in optimizer steps: step 1's second optimizer step is 1 ahead of its rows' weights;
    # later steps' rows are 2 optimizer steps old at the update's first optimizer step, 3 at its second.
    assert [m["rollout/staleness_max"] for m in metrics] == [1, 3, 3]
    assert [m["rollout/staleness_mean"] for m in metrics] == [0.5, 2.5, 2.5]
    # Decoupled PPO: each update's first optimizer step has ratio 1 (no clip: the denominator is
    # its own starting weights'); stale rows carry behaviour weights against the rollout's
    # log-probs, which older weights drew, so they differ from 1; step 1 is on-policy and has none.
    assert "actor/behaviour_weight_mean" not in metrics[0]
    for m in metrics:
        assert m["actor/clipfrac_first_step"] == 0.0 and "actor/clipfrac_step_2" in m
    for m in metrics[1:]:
        assert m["actor/behaviour_weight_mean"] != 1.0 and m["actor/behaviour_capped_mean"] < 1.0
        assert "actor/logprob_gap_max" not in m  # a stale row's difference is the weights' change
    # Every update went live on both replicas, the last one after the last step.
    assert [s["version"] for s in syncs] == [2, 4, 6]
    assert all(info["weights_sha256"] == syncs[-1]["trainer"] for info in syncs[-1]["replicas"])
    trainer.rollout_backend.close()


def test_async_stop_finishes_the_step_and_saves_the_data_position_before_the_early_rollout(
    make_cfg, rollout_servers, tiny_sd3_path, monkeypatch, build_trainer
):
    """A stop signal during step 2's update (step 3's rollout is out) drops no phase midway: step 2
    completes and its checkpoint has the data position from before step 3 drew its rows."""
    monkeypatch.setenv(wire.ADMIN_TOKEN_ENV, TOKEN)
    urls = rollout_servers(tiny_sd3_path, count=1, admin_token=TOKEN)
    cfg = make_cfg(*RUN, servers_override(urls), *ASYNC, "trainer.total_steps=4", output="stop")
    trainer = build_trainer(cfg)
    update = trainer.algorithm.updater.update

    def signalled_in_step_2(batch):
        if trainer.step == 1:  # step 2's update; what the SIGTERM handler does, with nothing abortable now
            trainer.signals._handle(signal.SIGTERM, None)
        return update(batch)

    trainer.algorithm.updater.update = signalled_in_step_2
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer.fit()
    assert stopped.value.step == 2 and stopped.value.saved_now
    state = json.loads((stopped.value.checkpoint / "state.json").read_text())["trainer"]
    assert state["rows_generated"] == 2 * 8 and state["data"]["position"] == 4


def test_decoupled_config_errors(make_cfg):
    with pytest.raises(ValueError, match="trainer.async_rollout.*rollout.servers or rollout.num_replicas"):
        make_cfg("trainer.async_rollout=true")
    with pytest.raises(ValueError, match="algorithm.old_log_prob.*older weights.*set algorithm.old_log_prob=recompute"):
        make_cfg("trainer.async_rollout=true", "rollout.num_replicas=1", "algorithm.old_log_prob=rollout")
    with pytest.raises(ValueError, match="rollout.sampling.logprobs.*behaviour weight"):
        make_cfg(*ASYNC, "rollout.num_replicas=1", "rollout.sampling.logprobs=false")
    # Rollout servers sample eagerly; a compiled trainer must score both sides of the ratio itself.
    with pytest.raises(ValueError, match="algorithm.old_log_prob.*two graphs.*old_log_prob=recompute"):
        make_cfg("rollout.num_replicas=1", "engine.compile=true", "algorithm.old_log_prob=rollout")
    make_cfg("rollout.num_replicas=1", "engine.compile=true", "algorithm.old_log_prob=recompute")
    with pytest.raises(ValueError, match="algorithm.behaviour_weight_cap"):
        make_cfg("algorithm.behaviour_weight_cap=0.5")
    with pytest.raises(ValueError, match="rollout.sde_window_draw"):
        make_cfg("rollout.sde_window_draw=sample")
    with pytest.raises(ValueError, match="rollout.num_replicas.*not both"):
        make_cfg("rollout.num_replicas=1", "rollout.servers=[http://127.0.0.1:8000]")
    with pytest.raises(ValueError, match="rollout.replica_devices.*one device per started replica"):
        make_cfg("rollout.num_replicas=2", "rollout.replica_devices=[cpu]")
    with pytest.raises(ValueError, match=r"rollout.servers.0.*base URL"):
        make_cfg("rollout.servers=[127.0.0.1:8000]")
    assert np.isfinite(make_cfg("rollout.num_replicas=2").rollout.request_timeout_s)


def test_started_replicas_survive_one_killed_mid_rollout_and_stop_on_exit(build_trainer, make_cfg, check_loopback_only):
    cfg = make_cfg(*RUN, "rollout.num_replicas=2", "trainer.total_steps=2", output="started")
    trainer = build_trainer(cfg)
    processes = trainer.rollout_backend.processes
    assert len(processes.processes) == 2 and all(p.poll() is None for p in processes.processes)
    check_loopback_only()
    balancer = trainer.agent_loop.balancer
    submit_batched, calls = balancer.submit_batched, []

    def killing(prompt, n, params):
        futures = submit_batched(prompt, n, params)
        calls.append(prompt)
        if len(calls) == 2:  # both replicas hold a group now: replica 0 dies with its group in flight
            processes.kill(0)
        return futures

    balancer.submit_batched = killing
    sizes = []
    rewards = trainer.samples.rewards

    def recording(sampled, step):
        scored = rewards(sampled, step)
        sizes.append((len(sampled.batch), int(np.isfinite(scored.rows.rewards).sum())))
        return scored

    trainer.samples.rewards = recording
    summary = trainer.fit()
    assert summary["steps"] == 2 and sizes == [(8, 8), (8, 8)]  # every sample of both steps
    assert balancer.is_dropped == [True, False] and balancer.num_resent >= 1
    assert all(p.poll() is not None for p in processes.processes)  # fit stopped the survivor too


def test_diffusion_nft_replicas_serve_the_old_policy(
    make_cfg, rollout_servers, tiny_sd3_path, monkeypatch, build_trainer
):
    """DiffusionNFT rolls out with its old policy: after each update the replica serves the old
    policy's weights (checksum), not the trained ones, and the run equals the colocated one."""
    monkeypatch.setenv(wire.ADMIN_TOKEN_ENV, TOKEN)
    nft = (
        *RUN,
        "algorithm.name=diffusion_nft",
        "rollout.sampling.noise_level=0",
        "rollout.sampling.logprobs=false",
        "algorithm.nft.old_decay_rate=0.4",
        "algorithm.nft.old_decay_max=0.9",
    )
    urls = rollout_servers(tiny_sd3_path, count=1, admin_token=TOKEN)
    decoupled = build_trainer(make_cfg(*nft, servers_override(urls), output="decoupled"))
    served = []
    publish = decoupled.rollout_backend.publish

    def recording(version):
        publish(version)
        transformer = decoupled.adapter.transformer
        with decoupled.algorithm.old.applied():
            old = wire.weights_sha256(trainable_state_dict(transformer))
        trained = wire.weights_sha256(trainable_state_dict(transformer))
        served.append((old, trained, decoupled.rollout_backend.balancer.live_replicas[0].weights_info()))

    decoupled.rollout_backend.publish = recording
    decoupled.rollouts.backend = decoupled.rollout_backend
    remote = run_steps(decoupled, 2)
    colocated = run_steps(build_trainer(make_cfg(*nft, output="colocated")), 2)
    assert len(served) == 2
    for old, trained, info in served:
        assert info["weights_sha256"] == old != trained
    for a, b in zip(remote, colocated):
        for key in ("reward/mean", "actor/policy_loss", "actor/old_deviation"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    decoupled.rollout_backend.close()
