"""The checks of a run over several processes, made before any process group or model exists: each
a ValueError naming the setting, its value and the fix.

`check_world(cfg, world_size, local_world_size)`: the config against the world it runs in (the
world size from torchrun's environment, or distributed.num_workers for Ray). It reads the config
and counts CUDA devices; it knows nothing of models or trainers.
"""

from __future__ import annotations

from flowrl.config.sections import FlowRLConfig


def check_world(cfg: FlowRLConfig, world_size: int, local_world_size: int | None) -> None:
    """ValueError when `cfg` cannot run on `world_size` ranks of a process group
    (`local_world_size` of them on this node; None: not known here, as on a Ray cluster)."""
    _check_prompts(cfg, world_size)
    _check_devices(cfg, local_world_size)
    _check_sharded_full_fine_tuning(cfg)  # over a process group, full fine-tuning shards the weights
    _check_rollout_servers(cfg, world_size)


def _check_prompts(cfg: FlowRLConfig, world_size: int) -> None:
    prompts, n = cfg.trainer.prompts_per_step, cfg.rollout.n
    if prompts < world_size:
        raise ValueError(
            f"rollout.n={n} is larger than the rows a rank holds: trainer.prompts_per_step={prompts} over "
            f"{world_size} ranks leaves {prompts * n / world_size:g} rows per rank, and a prompt's group of "
            f"rollout.n rows never spans ranks; set trainer.prompts_per_step to a multiple of {world_size} "
            f"(e.g. {world_size}) or run fewer ranks"
        )
    if prompts % world_size:
        raise ValueError(
            f"trainer.prompts_per_step={prompts} is not divisible by the world size {world_size}: every rank "
            f"rolls out the same number of whole prompt groups; set trainer.prompts_per_step to a multiple of "
            f"{world_size} (e.g. {prompts - prompts % world_size or world_size} or {prompts + world_size - prompts % world_size})"
        )


def _check_devices(cfg: FlowRLConfig, local_world_size: int | None) -> None:
    device, backend = cfg.model.device, cfg.distributed.backend
    uses_cuda = device.startswith("cuda") or (device == "auto" and _cuda_device_count() > 0)
    if backend == "nccl" and not uses_cuda:
        raise ValueError(
            f"distributed.backend=nccl needs CUDA devices, but model.device={device!r} runs on the CPU here; "
            "set distributed.backend=auto (gloo on the CPU)"
        )
    if not uses_cuda or local_world_size is None:
        return
    if ":" in device and local_world_size > 1:
        raise ValueError(
            f"model.device={device!r} puts all {local_world_size} ranks of this node on one GPU; set "
            "model.device=auto or cuda (each rank takes the GPU of its local rank)"
        )
    count = _cuda_device_count()
    if count < local_world_size:
        raise ValueError(
            f"{local_world_size} ranks on this node but {count} CUDA device(s) visible: each rank needs a GPU of "
            f"its own; start at most {count} per node (torchrun --nproc-per-node {count}), or set model.device=cpu"
        )


def _check_sharded_full_fine_tuning(cfg: FlowRLConfig) -> None:
    if cfg.trainer.lora.enabled:
        return
    if cfg.engine.compile:
        raise ValueError(
            "engine.compile=true with full fine-tuning over a process group (FSDP2-sharded weights) is not "
            "supported; set engine.compile=false, or train a LoRA (trainer.lora.enabled=true)"
        )
    if cfg.trainer.mixed_precision == "fp16":
        raise ValueError(
            "trainer.mixed_precision=fp16 with full fine-tuning over a process group (FSDP2-sharded weights) "
            "is not supported (its loss scaler does not handle sharded gradients); use bf16"
        )


def _check_rollout_servers(cfg: FlowRLConfig, world_size: int) -> None:
    """Rollout servers (and the async rollouts they allow) serve one trainer process: each rank
    would publish its own weights to the same replicas."""
    rollout = cfg.rollout
    if not rollout.is_decoupled:
        return
    setting = next(
        f"rollout.{key}={getattr(rollout, key)!r}"
        for key in ("servers", "num_replicas", "num_ray_actors", "ray_actors")
        if getattr(rollout, key)
    )
    also = " and trainer.async_rollout=true" if cfg.trainer.async_rollout else ""
    raise ValueError(
        f"{setting}{also} with data-parallel training over {world_size} rank(s) (distributed.launcher="
        f"{cfg.distributed.launcher!r}) is not supported: rollout servers take their weights from one trainer "
        "process; train in one process (distributed.launcher=none, no torchrun), or roll out on the ranks "
        "themselves (rollout.servers=[] rollout.num_replicas=0 rollout.num_ray_actors=0 rollout.ray_actors=[] trainer.async_rollout=false)"
    )


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()
