"""What runs inside each Ray Train worker of a Ray launch (flowrl.distributed.ray_launcher says how
the launch goes): the worker setup without Ray's torch process group, and the worker's entry.

`FlowrlProcessGroup` is TorchTrainer's config with a backend that shares each node's GPUs among its
workers (CUDA_VISIBLE_DEVICES, as Ray's torch backend does) and sets up no process group: torch's
TCPStore that Ray's backend starts listens on every interface of the machine. `run_worker` joins
flowrl's own instead: rank 0 binds a socket on its node's address (127.0.0.1 on a local Ray), hosts
the store on it and hands the address to the others through Ray Train's broadcast; then it runs the
per-rank function.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import ray
import ray.train
import ray.train.torch
import torch.distributed as dist
from ray.train.backend import Backend
from ray.train.collective import broadcast_from_rank_zero
from ray.train.torch import TorchConfig

from flowrl.distributed.process_group import join_process_group


class SharedDevices(Backend):
    """Ray Train's worker setup for torch without its process group: GPUs shared per node."""

    share_cuda_visible_devices = True


class FlowrlProcessGroup(TorchConfig):
    """TorchTrainer's config whose backend leaves the process group to flowrl."""

    @property
    def backend_cls(self):
        return SharedDevices


def run_worker(loop_config: dict) -> None:
    """One Ray Train worker: join flowrl's process group, run the per-rank function
    (loop_config: {"config": the run's config as a dict, "run_rank": the function, "cwd": the
    driver's working directory, which relative paths in the config are relative to})."""
    from flowrl.config import config_from_dict

    if os.path.isdir(loop_config["cwd"]):
        os.chdir(loop_config["cwd"])
    cfg = config_from_dict(loop_config["config"])
    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    listener = socket.create_server((ray.util.get_node_ip_address(), 0)) if rank == 0 else None
    host, port = broadcast_from_rank_zero(listener.getsockname()[:2] if listener else None)
    store = dist.TCPStore(
        host,
        port,
        size,
        is_master=rank == 0,
        timeout=timedelta(seconds=cfg.distributed.timeout_s),
        master_listen_fd=listener.fileno() if listener else None,
    )
    device = None
    if cfg.model.device != "cpu" and ray.get_gpu_ids():
        device = ray.train.torch.get_device()  # its GPU among the node's shared ones
    world = join_process_group(
        cfg, rank, size, context.get_local_rank(), context.get_local_world_size(), device=device, store=store
    )
    try:
        code = loop_config["run_rank"](cfg, world)
    finally:
        dist.destroy_process_group()
    if code:
        raise RuntimeError(f"rank {rank} ended with exit code {code} (its error is printed above)")
