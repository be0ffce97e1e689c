"""The engine as a Ray actor (flowrl.rollout.ray_actor, ray_engine, ray_rollouts) on a local Ray
bound to 127.0.0.1, one Ray for this file: an actor samples exactly what the in-process engine
samples; concurrent remote calls share forwards; a bad request is the engine's ValueError, through
Ray, before any work; weight updates are checked as the server checks them and go live with the
trainer's checksum; two actors train as the colocated run does, also when one is killed mid-rollout
(its groups re-sent); nothing of it listens off the loopback.

Ray is imported inside the tests only: it reads the loopback setting when first imported, which
the `local_ray` fixture (tests/conftest.py) sets first."""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'ray[train]')")

ROOT = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(height=32, width=32, num_inference_steps=3, noise_level=0.7, seed=11)
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "dropout": 0.0}
# A small LoRA run (tests/rollout/test_decoupled.py's): 2 prompts x 4 samples per step.
RUN = ("trainer.lora.enabled=true", "trainer.prompts_per_step=2", "rollout.n=4", "trainer.lr=0.01")
RAY_RUN = (*RUN, "rollout.num_ray_actors=2")
COMPARED = ("reward/mean", "reward/std", "actor/policy_loss", "actor/ratio_mean", "actor/grad_norm")


@pytest.fixture(scope="module")
def actor(local_ray, tiny_sd3_path):
    from flowrl.rollout.ray_actor import EngineActor

    handle = EngineActor.options(name="engine-under-test").remote(str(tiny_sd3_path))
    local_ray.get(handle.health.remote())  # loaded
    yield handle
    local_ray.kill(handle)


@pytest.fixture(scope="module")
def engine(tiny_sd3_path):
    from flowrl.engine import DiffusionEngine

    reference = DiffusionEngine.from_pretrained(tiny_sd3_path)
    yield reference
    reference.shutdown()


@pytest.fixture(scope="module")
def colocated_metrics(tiny_run_config, tmp_path_factory):
    """The metrics of 2 steps of RUN on the trainer's own engine."""
    from flowrl.trainer.trainer import Trainer

    trainer = Trainer(tiny_run_config(tmp_path_factory.mktemp("colocated"), *RUN))
    try:
        return [trainer.train_step() for _ in range(2)]
    finally:
        trainer.close()


def assert_same_outputs(remote, local):
    assert len(remote) == len(local)
    for a, b in zip(remote, local):
        assert (a.prompt, a.seed, a.policy_version, a.sde_window, a.transition_spec) == (
            b.prompt,
            b.seed,
            b.policy_version,
            b.sde_window,
            b.transition_spec,
        )
        for name in ("image", "all_latents", "all_log_probs", "sigmas", "next_sigmas", "prompt_embeds"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-6, rtol=0, msg=name)


def test_an_actor_samples_what_the_in_process_engine_samples(local_ray, actor, engine, check_loopback_only):
    remote = local_ray.get(actor.generate_batched.remote("a red square", 3, PARAMS))
    assert_same_outputs(remote, engine.generate_batched("a red square", 3, PARAMS))
    prompts = ["a blue circle", "a green triangle"]
    remote = local_ray.get(actor.submit_many.remote(prompts, PARAMS, 2))
    assert_same_outputs(remote, [f.result() for f in engine.submit_many(prompts, PARAMS, 2)])
    assert [o.seed for o in remote] == [11, 12, 13, 14]
    check_loopback_only()  # Ray's servers and the actor's worker included


def test_concurrent_remote_calls_share_forwards_and_none_is_lost(local_ray, actor):
    local_ray.get(actor.reset_stats.remote())
    refs = [actor.generate.remote(f"prompt {i}", PARAMS.replace(seed=i)) for i in range(64)]
    outputs = local_ray.get(refs)
    assert [(o.prompt, o.seed) for o in outputs] == [(f"prompt {i}", i) for i in range(64)]
    stats = local_ray.get(actor.stats.remote())
    assert stats["num_samples_finished"] == 64
    assert stats["mean_rows_per_forward"] > 2, stats


def test_a_bad_request_is_the_engines_value_error_through_ray_before_any_work(local_ray, actor):
    from flowrl.rollout.ray_engine import RayEngine

    local_ray.get(actor.reset_stats.remote())
    with pytest.raises(ValueError, match=r"num_outputs_per_prompt=0 must be an integer >= 1"):
        local_ray.get(actor.generate_batched.remote("a cat", 0, PARAMS))
    with pytest.raises(ValueError, match="height"):
        local_ray.get(actor.generate.remote("a cat", PARAMS.replace(height=33)))
    stats = local_ray.get(actor.stats.remote())
    assert stats["num_forwards"] == 0 and stats["num_samples_finished"] == 0
    handle = RayEngine(actor)  # the handle refuses the same before sending anything
    with pytest.raises(ValueError, match="num_outputs_per_prompt=0"):
        handle.submit_batched("a cat", 0, PARAMS)
    assert len(handle.generate_batched("a cat", 2, PARAMS)) == 2  # and the actor still serves


def test_pause_holds_new_calls_until_resume(local_ray, actor):
    assert local_ray.get(actor.pause.remote())["status"] == "paused"
    held = actor.generate.remote("a cat", PARAMS)
    ready, _ = local_ray.wait([held], timeout=1.0)
    assert not ready
    assert local_ray.get(actor.resume.remote())["status"] == "ok"
    assert local_ray.get(held, timeout=60).seed == PARAMS.seed


def test_a_call_past_the_handles_timeout_counts_the_actor_down(local_ray, actor):
    from flowrl.rollout.ray_engine import ActorDownError, RayEngine

    handle = RayEngine(actor, "slow", timeout_s=0.5)
    local_ray.get(actor.pause.remote())  # the call waits at the gate past its time
    try:
        [future] = handle.submit_batched("a cat", 1, PARAMS)
        with pytest.raises(ActorDownError, match=r"engine actor slow: a call failed \(no answer in 0.5 s\)"):
            future.result(timeout=30)
    finally:
        local_ray.get(actor.resume.remote())


def test_named_actors_are_used_and_left_running(local_ray, actor, make_cfg):
    from flowrl.rollout.ray_rollouts import open_engine_actors

    with pytest.raises(ValueError, match=r"rollout.ray_actors.1='missing': no actor of that name"):
        open_engine_actors(make_cfg("rollout.ray_actors=[engine-under-test,missing]"))
    cfg = make_cfg("rollout.ray_actors=[engine-under-test]")
    actors = open_engine_actors(cfg)
    [handle] = actors.connect(cfg.rollout)
    assert handle.name == "engine-under-test" and handle.generate("a cat", PARAMS).seed == PARAMS.seed
    actors.close()
    assert local_ray.get(actor.health.remote())["status"] == "ok"  # not the trainer's to kill
    assert local_ray.is_initialized()


def test_weight_updates_are_checked_and_go_live_with_the_trainers_checksum(local_ray, tiny_sd3_path):
    """Its own actor: the weights it takes stay out of the other tests."""
    from flowrl.client.weights import WeightsUpload
    from flowrl.config.sections import LoraConfig
    from flowrl.engine import DiffusionEngine
    from flowrl.models.lora import apply_trainable, trainable_state_dict
    from flowrl.rollout.ray_actor import EngineActor
    from flowrl.rollout.ray_engine import RayEngine, StoredUpload
    from flowrl.server import wire

    handle = RayEngine(EngineActor.remote(str(tiny_sd3_path)), "updated", timeout_s=120)
    with DiffusionEngine.from_pretrained(tiny_sd3_path) as reference:
        transformer = reference.adapter.transformer
        apply_trainable(transformer, LoraConfig(enabled=True, init="default", **LORA))
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in trainable_state_dict(transformer).values():
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
        state = {name: t.clone() for name, t in trainable_state_dict(transformer).items()}
        upload = WeightsUpload.of(state, LORA)
        before = handle.weights_info()
        damaged = StoredUpload(
            local_ray.put(upload.body[:-1] + b" "), wire.file_sha256(upload.body), upload.sha256, "lora"
        )
        with pytest.raises(ValueError, match="sha256 mismatch"):
            handle.push_weights(damaged, 1)
        with pytest.raises(ValueError, match="version='-1' must be an integer >= 0"):
            handle.push_weights(upload, -1)
        assert handle.weights_info() == before  # refused: nothing changed
        handle.push_weights(upload, 1)
        info = handle.weights_info()
        assert (info["policy_version"], info["kind"], info["weights_sha256"]) == (1, "lora", wire.weights_sha256(state))
        remote = handle.generate_batched("a red square", 2, PARAMS)
        assert [o.policy_version for o in remote] == [1, 1]
        reference.set_policy_version(1)
        assert_same_outputs(remote, reference.generate_batched("a red square", 2, PARAMS))
    local_ray.kill(handle.actor)


def record_syncs(trainer) -> list[dict]:
    """After every publish: the trainer's weights checksum and what each live actor serves."""
    from flowrl.models.lora import trainable_state_dict
    from flowrl.server import wire

    records, publish = [], trainer.rollout_backend.publish

    def recording(version):
        publish(version)
        transformer = trainer.adapter.transformer
        replicas = [c.weights_info() for c in trainer.rollout_backend.balancer.live_replicas]
        records.append(
            {
                "version": version,
                "trainer": wire.weights_sha256(trainable_state_dict(transformer)),
                "replicas": replicas,
            }
        )

    trainer.rollout_backend.publish = recording
    trainer.rollouts.backend = trainer.rollout_backend
    return records


def assert_metrics_match(ray_metrics, local_metrics):
    assert len(ray_metrics) == len(local_metrics) == 2
    for remote, local in zip(ray_metrics, local_metrics):
        assert remote["rollout/staleness_max"] == 0 and remote["rollout/policy_lag"] == 0
        for key in COMPARED:
            assert remote[key] == pytest.approx(local[key], rel=1e-4, abs=1e-6), key


def test_two_actors_train_as_the_colocated_run(
    local_ray, make_cfg, build_trainer, colocated_metrics, check_loopback_only
):
    trainer = build_trainer(make_cfg(*RAY_RUN, output="ray"))
    actors = [actor for _, actor in trainer.rollout_backend.actors.actors]
    syncs = record_syncs(trainer)
    metrics = [trainer.train_step() for _ in range(2)]
    check_loopback_only()
    # after each update both actors serve the trainer's weights exactly, and both took groups
    assert [s["version"] for s in syncs] == [1, 2]
    for sync in syncs:
        assert [(r["policy_version"], r["weights_sha256"]) for r in sync["replicas"]] == [
            (sync["version"], sync["trainer"])
        ] * 2
    assert all(count > 0 for count in trainer.agent_loop.balancer.assigned)
    assert_metrics_match(metrics, colocated_metrics)
    trainer.close()  # kills the actors it started; the Ray it joined keeps running
    assert all(is_dead_soon(local_ray, actor) for actor in actors)
    assert local_ray.is_initialized()


def is_dead_soon(ray, actor, timeout_s: float = 30.0) -> bool:
    """Whether `actor` answers with RayActorError within `timeout_s` (ray.kill lands asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.health.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.1)
    return False


# Slow-marked (about 37 s on a CI worker): the balancer's resend of a dead replica's groups is the
# same code on the server path, whose faster sibling is tests/rollout/test_decoupled.py's
# test_started_replicas_survive_one_killed_mid_rollout_and_stop_on_exit.
@pytest.mark.slow
def test_a_killed_actors_groups_are_resent_and_the_run_is_the_same(
    local_ray, make_cfg, build_trainer, colocated_metrics
):
    trainer = build_trainer(make_cfg(*RAY_RUN, "trainer.total_steps=2", output="killed"))
    first_actor = trainer.rollout_backend.actors.actors[0][1]
    local_ray.get(first_actor.pause.remote())  # the group it gets waits there until it dies
    balancer = trainer.agent_loop.balancer
    submit_batched, calls = balancer.submit_batched, []

    def killing(prompt, n, params):
        futures = submit_batched(prompt, n, params)
        calls.append(prompt)
        if len(calls) == 2:  # both actors hold a group now: actor 0 dies with its group in flight
            assert balancer.in_flight == [n, n]
            local_ray.kill(first_actor)
        return futures

    balancer.submit_batched = killing
    sizes, rewards = [], trainer.samples.rewards

    def recording(sampled, step):
        scored = rewards(sampled, step)
        sizes.append((len(sampled.batch), int(np.isfinite(scored.rows.rewards).sum())))
        return scored

    trainer.samples.rewards = recording
    metrics = [trainer.train_step() for _ in range(2)]
    assert sizes == [(8, 8), (8, 8)]  # every sample of both steps
    assert balancer.num_resent >= 1 and balancer.is_dropped == [True, False]
    assert "flowrl-rollout-0" in balancer.summary()
    assert_metrics_match(metrics, colocated_metrics)  # re-sent groups are the same samples


def test_the_ray_pages_example_runs_as_written(local_ray, monkeypatch, capsys):
    """docs/ray.md's first example, on this file's Ray (its `ray.init()` joins it), from the repository root."""
    example = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "ray.md").read_text(), re.S)[0]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(local_ray, "init", lambda *args, **kwargs: None)
    namespace = {}
    try:
        exec(compile(example, "docs/ray.md", "exec"), namespace)
    finally:
        if "engine" in namespace:
            local_ray.kill(namespace["engine"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "torch.Size([3, 48, 48]) torch.Size([7]) 0"
    count, rows_per_forward = printed[1].split()
    assert count == "16" and float(rows_per_forward) > 2
    assert "num_outputs_per_prompt=0 must be an integer >= 1" in printed[2]


def test_ray_replica_config_errors(make_cfg):
    with pytest.raises(ValueError, match=r"rollout.num_ray_actors=-1 is invalid"):
        make_cfg("rollout.num_ray_actors=-1")
    with pytest.raises(ValueError, match=r"rollout.num_ray_actors=2 is invalid: rollout.num_replicas is set too"):
        make_cfg("rollout.num_replicas=1", "rollout.num_ray_actors=2")
    with pytest.raises(ValueError, match=r"rollout.ray_actors=\['a'\] is invalid: rollout.servers is set too"):
        make_cfg("rollout.servers=[http://127.0.0.1:8000]", "rollout.ray_actors=[a]")
    with pytest.raises(ValueError, match=r"rollout.ray_actors=\['a'\] is invalid: rollout.num_ray_actors is set too"):
        make_cfg("rollout.num_ray_actors=1", "rollout.ray_actors=[a]")
    with pytest.raises(ValueError, match=r"rollout.ray_actors.0='a/b/c' is invalid: .*NAMESPACE/NAME"):
        make_cfg("rollout.ray_actors=[a/b/c]")
    assert make_cfg("rollout.ray_actors=[ns/engine]").rollout.is_decoupled
    assert make_cfg("rollout.num_ray_actors=1").rollout.is_on_ray
    assert not make_cfg("rollout.num_replicas=1").rollout.is_on_ray
