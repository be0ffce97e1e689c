"""Data-parallel training over many processes, GPUs and nodes.

- `world.py`: `World`, this process's rank, the world size and the trainer's few collectives (one
  process is a World too, whose collectives return their inputs);
- `parallel.py`: `DataParallel`, how the trained weights are kept over ranks (replicated with a
  bucketed gradient all-reduce for LoRA, FSDP2-sharded for full fine-tuning) and gathered for
  rollouts and exports;
- `sharded_checkpoint.py`: checkpoint tensors of sharded weights through
  torch.distributed.checkpoint, readable at any world size, through the storage of
  `dcp_storage.py` (safetensors and a JSON index: nothing is unpickled);
- `checks.py`: the config against the world it runs in, before anything loads;
- `launch.py`: one process, torchrun's ranks, or Ray's (`ray_launcher.py` on the driver,
  `ray_worker.py` in each worker: the only modules that import Ray) each run the same per-rank
  function, after joining the process group (`process_group.py`).

docs/distributed.md says how to launch on one GPU, one node, several nodes and a Ray cluster.
"""
