"""Starting the ranks of a training run and running the per-rank function on each
(`distributed.launcher`, docs/distributed.md).

- one process (`flowrl train`): the function runs here with `World.single`;
- torchrun (`torchrun --nproc-per-node K -m flowrl train ...`, one node or several through
  torchrun's rendezvous): torchrun started this process as one rank and set RANK, WORLD_SIZE,
  LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; this process joins the group;
- Ray (`distributed.launcher=ray`): flowrl.distributed.ray_launcher starts Ray Train workers, each
  joining the group through `join_process_group` and running the same function.

Every rank joins its process group through flowrl.distributed.process_group. The world is checked
(flowrl.distributed.checks) before a process group or a model exists.
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from flowrl.config.sections import FlowRLConfig
from flowrl.distributed.checks import check_world
from flowrl.distributed.process_group import RankFunction, join_process_group
from flowrl.distributed.world import World

# torchrun's environment of a rank (the variables torch.distributed's env:// rendezvous reads).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def started_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE"))


def torchrun_command_prefix(agent_argv: list[str] | None = None) -> list[str]:
    """The words of this rank's torchrun launch up to the module it runs (`torchrun
    --nproc-per-node 2 -m flowrl`), for a command that repeats the launch: from the torchrun agent's
    command line (`agent_argv`; by default its /proc entry, the rank's parent), else rebuilt from
    torchrun's environment (the node and process counts; rendezvous options only the command line
    holds)."""
    if agent_argv is None:
        try:
            agent_argv = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:  # not Linux, or no such entry
            agent_argv = []
    start = None
    if "torch.distributed.run" in agent_argv:  # python -m torch.distributed.run OPTIONS -m flowrl ...
        start = agent_argv.index("torch.distributed.run") + 1
    elif any(Path(word).name == "torchrun" for word in agent_argv[:2]):  # [python] .../torchrun OPTIONS ...
        start = next(i for i, word in enumerate(agent_argv[:2]) if Path(word).name == "torchrun") + 1
    module = next(
        (i for i, w in enumerate(agent_argv) if start is not None and i >= start and w in ("flowrl", "flowrl.cli")),
        None,
    )
    if module is not None:
        return ["torchrun", *agent_argv[start : module + 1]]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    nodes = int(os.environ.get("WORLD_SIZE", str(local))) // max(local, 1)
    return [
        "torchrun",
        *(["--nnodes", str(nodes)] if nodes > 1 else []),
        "--nproc-per-node",
        str(local),
        "-m",
        "flowrl",
    ]


def resolve_launcher(cfg: FlowRLConfig) -> str:
    """ "none", "torchrun" or "ray" for this process; ValueError when the setting contradicts how
    the process was started."""
    launcher, under_torchrun = cfg.distributed.launcher, started_by_torchrun()
    if launcher == "auto":
        return "torchrun" if under_torchrun else "none"
    if launcher == "torchrun" and not under_torchrun:
        raise ValueError(
            "distributed.launcher=torchrun but this process was not started by torchrun (RANK and WORLD_SIZE "
            "are unset); run `torchrun --nproc-per-node K -m flowrl train ...`, or set distributed.launcher=auto"
        )
    if launcher in ("none", "ray") and under_torchrun and int(os.environ["WORLD_SIZE"]) > 1:
        raise ValueError(
            f"distributed.launcher={launcher} but torchrun started {os.environ['WORLD_SIZE']} ranks; "
            "set distributed.launcher=auto (or torchrun), or run `flowrl train` without torchrun"
        )
    return launcher


def launch_training(cfg: FlowRLConfig, run_rank: RankFunction) -> int:
    """Run `run_rank(cfg, world)` on every rank of the configured launch; returns this process's
    exit code."""
    launcher = resolve_launcher(cfg)
    if launcher == "ray":
        from flowrl.distributed.ray_launcher import launch_on_ray

        return launch_on_ray(cfg, run_rank)
    if launcher == "none":
        return run_rank(cfg, World.single(cfg.model.resolve_device()))
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(f"torchrun's environment lacks {', '.join(missing)}; start the run with torchrun")
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    check_world(cfg, world_size, local_world_size)
    world = join_process_group(
        cfg,
        int(os.environ["RANK"]),
        world_size,
        int(os.environ["LOCAL_RANK"]),
        local_world_size,
        store=_torchrun_attempt_store(cfg),
    )
    try:
        return run_rank(cfg, world)
    finally:
        dist.destroy_process_group()


def end_rank_process(code: int) -> None:
    """End a torchrun rank's process with exit code `code` once its run has returned: stdout and
    stderr flushed and the atexit handlers run (logging's among them), then `os._exit`, without the
    interpreter's teardown and C++ static destructors. The gloo process group outlives
    destroy_process_group (torch's functional collectives, which FSDP2 and DTensor use, keep
    references to it), and its threads at that teardown can abort a rank whose run has finished
    ("terminate called without an active exception", pytorch#190489): torchrun reports the job as
    failed, or restarts it under --max-restarts."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _torchrun_attempt_store(cfg: FlowRLConfig) -> dist.Store | None:
    """torchrun's agent store, under a prefix of its own for this restart attempt (None: not
    torchrun's agent store; env:// sets up the store). A restarted group (--max-restarts) on the
    static rendezvous (--master-addr / --master-port) shares the store of the attempt before it,
    whose keys would hand the new ranks the dead ranks' addresses."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timedelta(seconds=cfg.distributed.timeout_s),
    )
    return dist.PrefixStore(f"flowrl/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
