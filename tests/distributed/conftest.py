"""Distributed test fixtures: runs shared by the test files as session fixtures (each torchrun
launch costs its processes' imports): `lora_reference` / `full_reference` (one process),
`lora_two_nodes` (torchrun --nnodes 2, one rank each) and `full_two_ranks` (torchrun
--nproc-per-node 2). The helpers live in distributed_runs.py.
"""

from __future__ import annotations

import sys
import time

import pytest
from distributed_runs import (
    BASE,
    FULL,
    LORA,
    TIMEOUT_S,
    Launch,
    check_launch,
    free_port,
    rank_env,
    run_together,
    torchrun,
    train_one_process,
)


@pytest.fixture(scope="session")
def lora_args(tiny_sd3_path):
    return (f"model.path={tiny_sd3_path}", *BASE, *LORA)


@pytest.fixture(scope="session")
def full_args(tiny_sd3_path):
    return (f"model.path={tiny_sd3_path}", *BASE, *FULL)


@pytest.fixture(scope="session")
def lora_reference(lora_args, tmp_path_factory):
    return train_one_process(lora_args, tmp_path_factory.mktemp("lora_reference"))


@pytest.fixture(scope="session")
def full_reference(full_args, tmp_path_factory):
    root = tmp_path_factory.mktemp("full_reference")
    return train_one_process(full_args, root / "run", record_dir=root / "rollouts")


@pytest.fixture(scope="session")
def lora_two_nodes(lora_args, tmp_path_factory):
    """`torchrun --nnodes 2 --nproc-per-node 1 -m flowrl train` twice, a c10d rendezvous on the
    loopback, as two machines would run it."""
    root = tmp_path_factory.mktemp("lora_two_nodes")
    port = free_port()
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "flowrl-test", "--local-addr", "127.0.0.1"]
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous]
    args = ["-m", "flowrl", "train", *lora_args, f"trainer.output_dir={root / 'run'}"]
    t0 = time.perf_counter()
    nodes = [[*command, "--rdzv-conf", f"is_host={int(node == 0)}", *args] for node in range(2)]
    returncode, log = run_together(nodes, rank_env(), TIMEOUT_S)
    return check_launch(Launch(root / "run", returncode, log, time.perf_counter() - t0))


@pytest.fixture(scope="session")
def full_two_ranks(full_args, tmp_path_factory):
    """Sharded full fine-tuning over two ranks, with gradient_checkpointing=auto: its probe (a
    forward through the sharded model, no backward) runs on every rank, the ranks agree (off on
    the tiny model) and the run still equals the one-process reference."""
    root = tmp_path_factory.mktemp("full_two_ranks")
    args = (*full_args, "trainer.gradient_checkpointing=auto")
    launch = torchrun(args, root / "run", env={"FLOWRL_TEST_RECORD": str(root / "rollouts")})
    launch.rollouts = root / "rollouts"
    return check_launch(launch)
