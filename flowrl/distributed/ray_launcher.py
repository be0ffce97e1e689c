"""`flowrl train distributed.launcher=ray`: the run's ranks as Ray Train workers, each running the
same per-rank function a torchrun rank runs. This module (the driver's side) and
flowrl.distributed.ray_worker (the workers') are the only ones of flowrl that import Ray; this one
imports it only when a launch starts, after setting the local Ray's environment, which Ray reads
when it is imported.

- The cluster: the one this process already joined, the one at distributed.address ("auto",
  "HOST:6379", "ray://HOST:10001"), or a local Ray started here, bound to 127.0.0.1
  (LOCAL_RAY_ENV: Ray's node address and every one of its servers on the loopback; gloo's sockets
  too) and shut down at the end.
- The workers: Ray Train's TorchTrainer with distributed.num_workers workers, one GPU each when
  the cluster has GPUs and model.device allows them; Ray shares a node's GPUs among its workers'
  CUDA_VISIBLE_DEVICES (as for any torch run), so NCCL sees its peers.
- The process group: joined by flowrl (`join_process_group`), not by Ray's TorchConfig, whose
  torch TCPStore listens on every interface of the machine: rank 0 binds a socket on its node's
  address (127.0.0.1 for the local Ray), hosts the store on it, and hands the address to the other
  ranks through Ray Train's broadcast.
- Faults: a worker that raises fails the run with its error, and this process returns 1; with
  distributed.max_restarts the group restarts that many times, resuming from the latest
  checkpoint (trainer.resume=auto).

Ray starts its workers in a folder of its own; each moves to this process's working directory when
its node has it, so relative paths in the config mean what they mean here (on a cluster whose
nodes lack it, give paths every node resolves). Ray Train keeps its run records under
<trainer.output_dir>/ray_train (a shared filesystem when the workers span nodes, as the
checkpoints need anyway).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from flowrl.config.sections import FlowRLConfig
from flowrl.distributed.checks import check_world
from flowrl.distributed.process_group import RankFunction

LOCAL_RAY_ENV = {
    # Ray's node address becomes 127.0.0.1 and its servers listen on it alone (read by `import ray`).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}
LOCAL_OBJECT_STORE_BYTES = 256 << 20  # the workers exchange a config and a few numbers, no tensors


def _loopback_interface() -> str:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def start_local_ray(object_store_memory: int = LOCAL_OBJECT_STORE_BYTES, **init_options):
    """A Ray on this machine alone, bound to 127.0.0.1; returns the ray module. init_options: more
    `ray.init` arguments (flowrl.rollout's engine actors give the GPUs the trainer leaves them)."""
    if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        print(
            "warning: Ray was imported before flowrl could set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, so the local "
            "Ray listens on this machine's network address; set it before importing Ray",
            file=sys.stderr,
        )
    for name, value in {**LOCAL_RAY_ENV, "GLOO_SOCKET_IFNAME": _loopback_interface()}.items():
        os.environ.setdefault(name, value)  # inherited by Ray's processes and workers
    import ray

    ray.init(
        include_dashboard=False,
        object_store_memory=object_store_memory,
        **init_options,
        # Every Ray process of the run: no third-party notices, none of the State API's (flowrl.console).
        runtime_env={"worker_process_setup_hook": "flowrl.console.quiet_local_ray_worker"},
    )
    return ray


def _uses_gpus(cfg: FlowRLConfig, ray) -> bool:
    """Whether each worker takes a GPU: model.device asks for CUDA, or "auto" on a cluster with GPUs."""
    device, num_gpus = cfg.model.device, ray.cluster_resources().get("GPU", 0)
    uses = device.startswith("cuda") or (device == "auto" and num_gpus > 0)
    if uses and num_gpus < cfg.distributed.num_workers:
        raise ValueError(
            f"distributed.num_workers={cfg.distributed.num_workers} workers need a GPU each but the Ray cluster has "
            f"{num_gpus:g}; set distributed.num_workers to at most {int(num_gpus)}, or model.device=cpu"
        )
    if ":" in device:
        raise ValueError(
            f"model.device={device!r} names one GPU, but each Ray worker takes the GPU Ray gives it; set model.device=auto"
        )
    return uses


def launch_on_ray(cfg: FlowRLConfig, run_rank: RankFunction) -> int:
    """Run `run_rank` on distributed.num_workers Ray Train workers; this process's exit code."""
    from flowrl.config import config_to_dict

    dcfg = cfg.distributed
    check_world(cfg, dcfg.num_workers, None)
    joined = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # this process's Ray (tests)
    if joined:
        import ray
    elif dcfg.address is None:
        ray = start_local_ray()
    else:
        import ray

        ray.init(address=dcfg.address, runtime_env={"worker_process_setup_hook": "flowrl.console.quiet_third_party"})
    # Ray Train's workers would send each print to its logger too: printed twice (read when they start).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    try:
        from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
        from ray.train.torch import TorchTrainer

        from flowrl.distributed import ray_worker

        trainer = TorchTrainer(
            ray_worker.run_worker,
            train_loop_config={"config": config_to_dict(cfg), "run_rank": run_rank, "cwd": os.getcwd()},
            torch_config=ray_worker.FlowrlProcessGroup(timeout_s=int(dcfg.timeout_s)),
            scaling_config=ScalingConfig(num_workers=dcfg.num_workers, use_gpu=_uses_gpus(cfg, ray)),
            run_config=RunConfig(
                name="flowrl-train",
                storage_path=str(Path(cfg.trainer.output_dir).resolve() / "ray_train"),
                failure_config=FailureConfig(max_failures=dcfg.max_restarts),
            ),
        )
        try:
            trainer.fit()
        except TrainingFailedError as error:
            print(f"flowrl train: error: a Ray worker failed: {error}", file=sys.stderr)
            return 1
        return 0
    finally:
        if not joined:
            ray.shutdown()
