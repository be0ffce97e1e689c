"""Where the trainer's training rollouts run, and how new weights get there.

- `ColocatedRollouts`: the trainer's own engine, whose transformer IS the trained module (the
  LoRA is injected in place): publishing a version only tags the samples admitted from then on.
- `DecoupledRollouts`: rollout servers (`flowrl serve`), either started by the user
  (`rollout.servers`) or started here (`rollout.num_replicas`, on `rollout.replica_devices`, and
  stopped on exit); requests are balanced over them per group (flowrl.rollout.balancer, with
  failover). Publishing a version uploads the trainable weights (the LoRA, or the full
  transformer) to every live replica through the client (flowrl.client.weights: encoded once,
  checked by checksum on arrival): the next rollout request is sent only after every replica
  serves that version with that checksum. With `rollout.num_ray_actors` or `rollout.ray_actors`
  the replicas are engine actors (`actors`: flowrl.rollout.ray_rollouts.EngineActors) and the
  weights travel through Ray's object store.

`open_rollout_backend(cfg, output_dir)` is called before the trainer loads its model (started
replicas load theirs meanwhile); `bind(engine)` then attaches the trainer's engine. The backend
knows the client and the trainable weights, nothing about the update or the rewards.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flowrl.client.errors import ReplicaDownError
from flowrl.client.weights import WeightsUpload
from flowrl.models.lora import lora_settings, trainable_state_dict
from flowrl.rollout.balancer import LeastInFlightBalancer, NoReplicaLeftError

logger = logging.getLogger(__name__)

# Counters summed over replicas; the rates are recomputed from the sums.
_SUMMED_STATS = ("num_forwards", "num_rows", "num_samples_finished", "num_samples_failed", "busy_seconds")


class ColocatedRollouts:
    """Rollouts on the trainer's own engine (module docstring)."""

    is_decoupled = False

    def __init__(self):
        self.engine = None

    def bind(self, engine, published_weights=None) -> None:
        self.engine = engine

    @property
    def replicas(self):
        """What the agent loop balances over: the trainer's engine."""
        return self.engine

    def publish(self, version: int) -> None:
        self.engine.set_policy_version(version)

    def reset_stats(self) -> None:
        if hasattr(self.engine, "reset_stats"):
            self.engine.reset_stats()

    def stats(self) -> dict | None:
        """The engine's batching counters (None: an engine that keeps none)."""
        return self.engine.stats() if hasattr(self.engine, "stats") else None

    def close(self) -> None:
        pass


class DecoupledRollouts:
    """Rollouts on rollout servers (module docstring)."""

    is_decoupled = True

    def __init__(self, rollout_cfg, urls: list[str] | None = None, processes=None, actors=None):
        self.config = rollout_cfg
        self.processes = processes  # flowrl.client.ReplicaProcesses started for this run, or None
        self.actors = actors  # flowrl.rollout.ray_rollouts.EngineActors (rollout.is_on_ray), or None
        self._urls = list(urls or [])
        self.engine = None
        self.clients: list = []
        self.balancer: LeastInFlightBalancer | None = None
        self.published: tuple[int, str] | None = None  # (version, checksum) every live replica serves

    def bind(self, engine, published_weights=None) -> None:
        """Attach the trainer's engine (its adapter holds the weights to publish; inside
        `published_weights()`, when given, they hold what the replicas serve: an algorithm's old
        policy); connect."""
        self.engine = engine
        self.published_weights = published_weights or contextlib.nullcontext
        self.clients = self.actors.connect(self.config) if self.actors is not None else self._connect_servers()
        self.balancer = LeastInFlightBalancer(self.clients, self.config.max_replica_failures)

    def _connect_servers(self) -> list:
        from flowrl.client import RemoteEngine

        token = None
        if self.processes is not None:
            self._urls = self.processes.wait_ready()
            token = self.processes.admin_token
        return [RemoteEngine(url, timeout_s=self.config.request_timeout_s, admin_token=token) for url in self._urls]

    @property
    def replicas(self) -> LeastInFlightBalancer:
        return self.balancer

    def publish(self, version: int) -> None:
        """Upload the trainer's trainable weights as `version` to every live replica and wait
        until each serves it with the same checksum (replicas that fail are dropped)."""
        adapter = self.engine.adapter
        transformer = adapter.transformer
        with self.published_weights():
            state, lora = trainable_state_dict(transformer), lora_settings(transformer)
            upload = WeightsUpload.of(state, lora, adapter.trained_component)
        if self.actors is not None:
            upload = self.actors.stored(upload)  # put once in the object store, read by every actor
        live = [i for i, c in enumerate(self.clients) if c in self.balancer.live_replicas]
        if not live:
            raise NoReplicaLeftError("no rollout replica is left to publish the new weights to")
        with ThreadPoolExecutor(max_workers=len(live)) as pool:
            futures = {index: pool.submit(self.clients[index].push_weights, upload, version) for index in live}
        for index, future in futures.items():
            error = future.exception()
            if error is not None:
                self.balancer.drop(index, f"the weights of version {version} did not go live: {error}")
        if not self.balancer.live_replicas:
            raise NoReplicaLeftError(
                f"no rollout replica took the weights of version {version}: " + self.balancer.summary()
            )
        self.published = (version, upload.sha256)

    def reset_stats(self) -> None:
        for client in self.balancer.live_replicas:
            _unless_down(client.reset_stats)

    def stats(self) -> dict:
        """The replicas' batching counters summed (the rates from the sums); replicas dropped or
        down are left out (their requests went elsewhere; failover, not metrics, handles them)."""
        per_replica = [s for s in (_unless_down(c.stats) for c in self.balancer.live_replicas) if s is not None]
        total = {name: sum(s.get(name, 0) for s in per_replica) for name in _SUMMED_STATS}
        total["mean_rows_per_forward"] = total["num_rows"] / total["num_forwards"] if total["num_forwards"] else 0.0
        busy = max((s.get("busy_seconds", 0.0) for s in per_replica), default=0.0)
        total["images_per_second"] = total["num_samples_finished"] / busy if busy > 0 else 0.0
        total["num_replicas"] = len(per_replica)
        return total

    def close(self) -> None:
        for client in self.clients:
            client.close()
        if self.processes is not None:
            self.processes.stop()
        if self.actors is not None:
            self.actors.close()


def _unless_down(call):
    """call(), or None when its replica is down."""
    try:
        return call()
    except ReplicaDownError:
        return None


def open_rollout_backend(cfg, output_dir: str | Path):
    """The backend the config asks for; started replicas begin loading their model now."""
    rollout = cfg.rollout
    if not rollout.is_decoupled:
        return ColocatedRollouts()
    if rollout.is_on_ray:
        from flowrl.rollout.ray_rollouts import open_engine_actors

        return DecoupledRollouts(rollout, actors=open_engine_actors(cfg))
    if rollout.servers:
        return DecoupledRollouts(rollout, urls=rollout.servers)
    from flowrl.client import ReplicaProcesses
    from flowrl.run.checks import resolve_model_path

    devices = list(rollout.replica_devices) or [cfg.model.resolve_device()] * rollout.num_replicas
    processes = ReplicaProcesses(
        resolve_model_path(cfg.model), devices, Path(output_dir) / "replicas", serve_args=replica_serve_args(cfg)
    )
    processes.launch()
    return DecoupledRollouts(rollout, processes=processes)


def replica_serve_args(cfg) -> list[str]:
    """The `flowrl serve` options that make a started replica sample as the trainer's engine does:
    the model's dtype and adapter options (text length; which expert of two is the trained
    `transformer` that weight updates go into), the trainer's mixed precision (the engine's autocast), the
    engine's batch limits and prompt cache (as KEY=VALUE overrides of the server's config)."""
    from flowrl.run.checks import engine_options

    args = ["--dtype", cfg.model.dtype, f"trainer.mixed_precision={cfg.trainer.mixed_precision}"]
    args += [f"engine.{name}={value}" for name, value in engine_options(cfg.engine).items()]
    for name, value in cfg.model.adapter_options().items():  # the text length; a two-expert model's trained expert
        args.append(f"model.{name}={value}")
    return args
