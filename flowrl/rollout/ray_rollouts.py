"""Decoupled training on Ray: the replicas are EngineActors (rollout.num_ray_actors, ray_actors).

`open_engine_actors(cfg)` joins the Ray cluster (the one this process joined, else the one at
RAY_ADDRESS) or starts a local Ray bound to 127.0.0.1 as the launcher does
(flowrl.distributed.ray_launcher), then looks up the actors named in `rollout.ray_actors`, or
starts `rollout.num_ray_actors` EngineActors of the trainer's model and sampling settings (one GPU
each when model.device is a GPU). They load their model while the trainer loads its own.

flowrl.rollout.backends.DecoupledRollouts drives them as it drives HTTP replicas (groups balanced
and re-sent by flowrl.rollout.balancer), through `EngineActors`: `connect` gives one RayEngine
handle per actor once it serves, `stored` puts the weights of each update in the object store
once (every actor reads that copy and checks its checksum), `close` kills the actors started here
and shuts down a Ray started here.
"""

from __future__ import annotations

import os
import sys


class EngineActors:
    """The engine actors of a run (module docstring). actors: (name, ActorHandle) pairs."""

    def __init__(self, actors: list, started: bool, joined_here: bool):
        self.actors = actors
        self.started = started  # the actors are the run's: killed on close
        self.joined_here = joined_here  # Ray was started or connected to here: shut down (disconnected) on close

    def connect(self, rollout_cfg) -> list:
        """A RayEngine per actor (rollout.request_timeout_s per call), once each serves."""
        import ray

        from flowrl.rollout.ray_engine import RayEngine

        for index, (name, actor) in enumerate(self.actors):
            try:
                ray.get(actor.health.remote())  # waits for the actor's model to load
            except ray.exceptions.RayError as error:
                self.close()
                raise RuntimeError(f"engine actor {index} ({name}) is not serving: {error}") from None
        return [RayEngine(actor, name, timeout_s=rollout_cfg.request_timeout_s) for name, actor in self.actors]

    @staticmethod
    def stored(upload):
        from flowrl.rollout.ray_engine import StoredUpload

        return StoredUpload.of(upload)

    def close(self) -> None:
        import ray

        if self.started:
            for _, actor in self.actors:
                ray.kill(actor)
        self.actors = []
        if self.joined_here and ray.is_initialized():
            ray.shutdown()


def open_engine_actors(cfg) -> EngineActors:
    """The actors of `cfg.rollout` (module docstring); those started here begin loading now."""
    rollout = cfg.rollout
    ray, joined_here = _join_ray(cfg.model.resolve_device())
    try:
        if rollout.ray_actors:
            named = [(name, _named_actor(ray, i, name)) for i, name in enumerate(rollout.ray_actors)]
            return EngineActors(named, started=False, joined_here=joined_here)
        return EngineActors(_start_actors(cfg, ray), started=True, joined_here=joined_here)
    except BaseException:
        if joined_here:
            ray.shutdown()
        raise


def _join_ray(device: str):
    """(ray, whether it was joined here): the Ray this process joined, the cluster at RAY_ADDRESS,
    or a local Ray on 127.0.0.1 that sees every GPU but the trainer's."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return sys.modules["ray"], False
    if os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(runtime_env={"worker_process_setup_hook": "flowrl.console.quiet_third_party"})
        return ray, True
    from flowrl.distributed.ray_launcher import start_local_ray

    if device == "cpu":
        return start_local_ray(object_store_memory=None, num_gpus=0), True
    gpus = _gpus_beside(device)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # read by Ray as it starts: the actors' GPUs
    try:
        return start_local_ray(object_store_memory=None, num_gpus=len(gpus)), True
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _gpus_beside(device: str) -> list[str]:
    """This machine's visible GPUs (CUDA_VISIBLE_DEVICES' entries) but the trainer's `device`."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible is not None else []
    ids = ids or [str(i) for i in range(torch.cuda.device_count())]
    mine = int(device.partition(":")[2] or 0)
    return [gpu for i, gpu in enumerate(ids) if i != mine]


def _named_actor(ray, index: int, entry: str):
    namespace, _, name = entry.rpartition("/")
    try:
        return ray.get_actor(name, namespace=namespace or None)
    except ValueError:
        raise ValueError(
            f"rollout.ray_actors.{index}={entry!r}: no actor of that name is running on the Ray cluster "
            f"({ray.get_runtime_context().gcs_address}); start it first (docs/ray.md) or fix the name "
            "(NAMESPACE/NAME for an actor of another namespace)"
        ) from None


def _start_actors(cfg, ray) -> list:
    """rollout.num_ray_actors EngineActors of the trainer's model, dtype, mixed precision, text
    length and engine batch limits (eager, as started `flowrl serve` replicas run)."""
    from flowrl.rollout.ray_actor import EngineActor
    from flowrl.run.checks import engine_options, resolve_model_path

    count = cfg.rollout.num_ray_actors
    on_gpu = cfg.model.resolve_device() != "cpu"
    if on_gpu and ray.cluster_resources().get("GPU", 0) < count:
        raise ValueError(
            f"rollout.num_ray_actors={count} engine actors need a GPU each but the Ray cluster has "
            f"{ray.cluster_resources().get('GPU', 0):g} beside the trainer's; lower rollout.num_ray_actors, "
            "or use a cluster with more GPUs (RAY_ADDRESS)"
        )
    settings = dict(
        device="cuda" if on_gpu else "cpu",
        dtype=cfg.model.dtype,
        mixed_precision=cfg.trainer.mixed_precision,
        **engine_options(cfg.engine),
        **cfg.model.adapter_options(),
    )
    path = str(resolve_model_path(cfg.model))
    options = {"num_gpus": 1} if on_gpu else {"num_cpus": 0}
    # Labels, not Ray names: a later run in the same namespace never finds a name still taken.
    return [(f"flowrl-rollout-{i}", EngineActor.options(**options).remote(path, **settings)) for i in range(count)]
