"""torchrun launches of `flowrl train` on the loopback equal the one-process run of the same global
batch: rollouts, per-step rewards and the whole final/ pipeline folder, EMA weights included (LoRA
over two "nodes", full fine-tuning with FSDP2 over two ranks of one node), and checkpoints move
between world sizes: one saved by 2 ranks resumes in one process, one saved by one process resumes
over 2 ranks, as the uninterrupted run; a sharded checkpoint is verified by its manifest and planned
by resume.plan_run as any other."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from distributed_runs import (
    assert_same_training,
    check_launch,
    final_weights,
    max_weight_difference,
    metrics,
    one_thread,
    torchrun,
    train_one_process,
)

from flowrl.config import config_to_dict
from flowrl.run import resume
from flowrl.run.checkpoint import CheckpointError, verify_checkpoint
from flowrl.run.config import load_train_config


def test_lora_over_two_nodes_equals_one_process(lora_two_nodes, lora_reference):
    assert_same_training(lora_two_nodes.output, lora_reference)  # final/: fused transformer, lora/, ema/lora/
    assert (lora_two_nodes.output / "checkpoints" / "step_000002" / "trainable.safetensors").is_file()
    assert (lora_two_nodes.output / "val" / "step_000002.png").is_file()  # rank 0 wrote the grid of all 3 prompts


def test_sharded_full_fine_tuning_equals_one_process(full_two_ranks, full_reference):
    assert_same_training(full_two_ranks.output, full_reference)  # final/: gathered transformer, ema/transformer/
    # Each rank rolled out its 2 prompts' rows with the seeds those rows have in one process.
    reference = full_reference.parent / "rollouts"
    for rollout in (1, 2):
        one = torch.load(reference / f"rank0-rollout{rollout}.pt")
        ranks = [torch.load(full_two_ranks.rollouts / f"rank{r}-rollout{rollout}.pt") for r in (0, 1)]
        assert [s for part in ranks for s in part["seeds"]] == one["seeds"]
        for key in ("all_latents", "all_log_probs"):
            joined = torch.cat([part[key] for part in ranks])
            # Step 1 samples the same weights (bit-identical here; a CPU whose kernels round by batch
            # size may differ in the last bit); step 2 weights a float32 rounding apart.
            assert (joined - one[key]).abs().max() <= (1e-6 if rollout == 1 else 1e-5), (rollout, key)
    assert (full_two_ranks.output / "checkpoints" / "step_000001" / "sharded").is_dir()


def test_sharded_checkpoint_is_verified_and_planned_as_any_other(full_two_ranks, full_args, tmp_path, capsys):
    """manifest.json covers the shards and their index; trainer.resume=auto skips a checkpoint with a damaged
    shard, and RESUME_RULES apply (distributed.* may change, trainer.lora.* may not)."""
    for step in (1, 2):
        saved = full_two_ranks.output / "checkpoints" / f"step_{step:06d}"
        shutil.copytree(saved, tmp_path / "checkpoints" / saved.name)
    newest = tmp_path / "checkpoints" / "step_000002"
    listed = json.loads((newest / "manifest.json").read_text())["files"]
    files = sorted(f"sharded/{p.name}" for p in (newest / "sharded").iterdir())  # no pickled .metadata
    assert [f.removeprefix("sharded/") for f in files] == [
        "index.json",
        "optimizer.json",
        "rank0.safetensors",
        "rank1.safetensors",
    ]
    assert set(files) <= set(listed)
    shards = files[2:]
    assert verify_checkpoint(newest)
    with (newest / shards[0]).open("r+b") as handle:  # flip one byte of a shard
        handle.seek(8)
        byte = handle.read(1)
        handle.seek(8)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=f"{shards[0]} does not match its sha256"):
        verify_checkpoint(newest)
    overrides = [*full_args, f"trainer.output_dir={tmp_path}", "trainer.total_steps=3", "distributed.launcher=none"]
    cfg = load_train_config(None, overrides)
    plan = resume.plan_run(cfg, config_to_dict(cfg))
    assert plan.checkpoint == tmp_path / "checkpoints" / "step_000001" and plan.finished is None
    assert "distributed.launcher" in " ".join(plan.report)
    assert f"skipping checkpoint {newest}" in capsys.readouterr().err
    cfg = load_train_config(None, [*overrides, "trainer.lora.enabled=true"])
    with pytest.raises(ValueError, match=r"trainer\.lora\.enabled \(False -> True\)"):
        resume.plan_run(cfg, config_to_dict(cfg))


def test_sharded_checkpoint_resumes_at_world_size_one(build_trainer, full_two_ranks, full_args, tmp_path):
    saved = full_two_ranks.output / "checkpoints" / "step_000001"
    cfg = load_train_config(None, [*full_args, f"trainer.output_dir={tmp_path / 'run'}", f"trainer.resume={saved}"])
    with one_thread():
        trainer = build_trainer(cfg)
        assert trainer.step == 1 and trainer.policy_version == 2 and trainer.ema.num_updates == 2
        trainer.fit()
    straight = {r["step"]: r for r in metrics(full_two_ranks.output)}
    assert abs(metrics(tmp_path / "run")[-1]["reward/mean"] - straight[2]["reward/mean"]) < 1e-6
    for folder in ("transformer", "ema/transformer"):
        resumed, uninterrupted = final_weights(tmp_path / "run", folder), final_weights(full_two_ranks.output, folder)
        assert max_weight_difference(resumed, uninterrupted) < 1e-5, folder


def test_one_process_checkpoint_resumes_sharded_over_two_ranks(full_reference, full_args, tmp_path):
    saved = full_reference / "checkpoints" / "step_000001"
    assert (saved / "trainable.safetensors").is_file()  # whole tensors, read into each rank's shards
    launch = check_launch(torchrun([*full_args, f"trainer.resume={saved}"], tmp_path / "run"))
    assert "resumed from" in launch.log
    assert abs(metrics(tmp_path / "run")[-1]["reward/mean"] - metrics(full_reference)[-1]["reward/mean"]) < 1e-6
    for folder in ("transformer", "ema/transformer"):
        resumed, uninterrupted = final_weights(tmp_path / "run", folder), final_weights(full_reference, folder)
        assert max_weight_difference(resumed, uninterrupted) < 1e-5, folder


def test_generate_reads_the_sharded_checkpoints_of_a_two_rank_run(full_two_ranks, tiny_sd3_path, tmp_path):
    """`flowrl generate --run` of a sharded full fine-tune takes its newest checkpoint (sharded/),
    gathered in one process: the images of final/transformer, which rank 0 gathered in training."""
    import numpy as np
    from PIL import Image

    from flowrl.cli import main

    def generate(name, *flags):
        assert main(["generate", *flags, "--prompt", "a red apple", "--out", str(tmp_path / name)]) == 0
        assert "step_000002" in (tmp_path / name / "stats.json").read_text() or name == "final"
        return np.stack([np.asarray(Image.open(p)) for p in sorted((tmp_path / name).glob("p*_s*.png"))])

    final = full_two_ranks.output / "final" / "transformer"
    run = generate("run", "--run", str(full_two_ranks.output))
    assert np.array_equal(run, generate("final", "--model", str(tiny_sd3_path), "--transformer", str(final)))


NFT = (
    "algorithm.name=diffusion_nft",
    "algorithm.old_log_prob=rollout",  # the FlowGRPO default: BASE's recompute is not an NFT setting
    "rollout.sampling.noise_level=0",
    "rollout.sampling.logprobs=false",
    "rollout.sampling.sde_window_size=null",
    "algorithm.train_timestep_fraction=0.5",
    "algorithm.nft.old_decay_rate=0.3",
    "algorithm.nft.old_decay_max=0.9",
)


@pytest.mark.slow
def test_diffusion_nft_sharded_over_two_ranks_equals_one_process(full_args, tmp_path):
    """DiffusionNFT's old policy (an average kept in each rank's shards, swapped in before the
    rollout gathers the weights), its per-pair noise (drawn by each sample's index among every
    rank's) and its update over FSDP2 compute what one process does (about a minute; its faster
    siblings: the sharded FlowGRPO run above, and tests/trainer/test_diffusion_nft.py's rollouts
    from the old policy and update as the mean of its pairs' losses in one process)."""
    args = (*full_args, *NFT, "trainer.val_every=0", "trainer.save_every=2")
    one = train_one_process(args, tmp_path / "one")
    two = check_launch(torchrun(args, tmp_path / "two")).output
    assert_same_training(two, one)
    for rank_run in (one, two):
        assert (rank_run / "checkpoints" / "step_000002").is_dir()


# A tiny Wan at 5 frames of 32 x 32, scored by a per-frame reward whose spread keeps the
# advantages well conditioned (a near-constant reward turns float noise into different advantages).
WAN_VIDEO = (
    "model.max_sequence_length=16",
    "reward.name=per_frame",
    "reward.options.reward=image_flatness",
    *(
        f"rollout.{s}.{k}={v}"
        for s in ("sampling", "val_sampling")
        for k, v in (("height", 32), ("width", 32), ("num_frames", 5))
    ),
)


@pytest.mark.slow
def test_wan_sharded_full_fine_tuning_equals_one_process(tmp_path):
    """Wan2.1 (video latents with a frame axis; root and block `scale_shift_table` parameters whose
    first dimension, 1, is smaller than the world) fully fine-tuned over FSDP2 on two ranks: the
    same training and final/ folder as one process (about 25 s; its faster sibling is the sharded
    SD3 run above, and tests/distributed/test_parallel.py's gathered-state test)."""
    from distributed_runs import BASE, FULL

    from flowrl.models.debug.tiny import build_tiny_checkpoint

    args = (f"model.path={build_tiny_checkpoint('wan', tmp_path / 'wan', seed=0)}", *BASE, *FULL, *WAN_VIDEO)
    one = train_one_process(args, tmp_path / "one")
    two = check_launch(torchrun(args, tmp_path / "two")).output
    assert_same_training(two, one)
