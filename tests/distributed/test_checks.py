"""A config that cannot run on its world fails at once, before any process group or model exists,
with one error naming the setting and the fix."""

from __future__ import annotations

import re

import pytest

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.distributed import checks
from flowrl.distributed.checks import check_world

TORCHRUN_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",  # nothing may connect: the checks come first
}


@pytest.mark.parametrize(
    "overrides, world, match",
    [
        (
            ["trainer.prompts_per_step=3"],
            2,
            r"trainer.prompts_per_step=3 is not divisible by the world size 2.*multiple of 2",
        ),
        (
            ["trainer.prompts_per_step=2", "rollout.n=4"],
            4,
            r"rollout.n=4 is larger than the rows a rank holds.*multiple of 4",
        ),
        (["trainer.lora.enabled=false", "engine.compile=true"], 2, r"engine.compile=true with full fine-tuning"),
        (["trainer.lora.enabled=false", "trainer.mixed_precision=fp16"], 2, r"fp16 .*use bf16"),
        (["distributed.backend=nccl", "model.device=cpu"], 2, r"distributed.backend=nccl needs CUDA.*backend=auto"),
        (
            ["rollout.servers=[http://127.0.0.1:1]"],
            2,
            r"rollout.servers=\['http://127.0.0.1:1'\] with data-parallel training over 2 rank.*launcher=none",
        ),
        (
            ["rollout.num_replicas=2", "trainer.async_rollout=true", "algorithm.old_log_prob=recompute"],
            2,
            r"rollout.num_replicas=2 and trainer.async_rollout=true with data-parallel.*rollout.num_replicas=0",
        ),
    ],
)
def test_check_world_names_the_setting_and_the_fix(overrides, world, match):
    with pytest.raises(ValueError, match=match):
        check_world(load_config(None, overrides), world, 1)


def test_more_ranks_on_a_node_than_gpus_is_an_error(monkeypatch):
    monkeypatch.setattr(checks, "_cuda_device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"2 ranks on this node but 1 CUDA device.*--nproc-per-node 1"):
        check_world(load_config(None, ["model.device=cuda"]), 2, 2)
    with pytest.raises(ValueError, match=r"model.device='cuda:0' puts all 2 ranks of this node on one GPU"):
        check_world(load_config(None, ["model.device=cuda:0"]), 2, 2)


def test_torchrun_rank_fails_before_loading_anything(monkeypatch, capsys):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    # The model path does not exist either: the world check comes before anything reads it.
    assert main(["train", "trainer.prompts_per_step=3", "model.path=/does/not/exist"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.prompts_per_step=3 is not divisible by the world size 2" in err[0]


def test_torchrun_rank_with_rollout_servers_fails_before_starting_replicas(monkeypatch, capsys, tmp_path):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    args = ["train", "rollout.num_replicas=1", f"trainer.output_dir={tmp_path / 'run'}", "model.path=/does/not/exist"]
    assert main(args) == 2
    assert "rollout.num_replicas=1 with data-parallel training over 2 rank(s)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_ray_launch_fails_before_starting_ray(capsys):
    args = ["train", "distributed.launcher=ray", "distributed.num_workers=3", "model.path=/does/not/exist"]
    assert main(args) == 2
    assert "not divisible by the world size 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, env, match",
    [
        (
            ["distributed.launcher=torchrun"],
            {},
            r"not started by torchrun.*torchrun --nproc-per-node K -m flowrl train",
        ),
        (["distributed.launcher=none"], TORCHRUN_ENV, r"distributed.launcher=none but torchrun started 2 ranks"),
        (
            ["distributed.num_workers=2"],
            {},
            r"distributed.num_workers=2 is invalid: it applies to distributed.launcher=ray only",
        ),
    ],
)
def test_launcher_settings_that_contradict_the_launch(monkeypatch, capsys, overrides, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["train", *overrides]) == 2
    assert re.search(match, capsys.readouterr().err)
