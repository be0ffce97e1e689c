"""CLI smoke tests of `flowrl bench rollout` on the tiny models (CPU),
through the real entry point, checking the properties the reports promise."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.cli import main


def test_bench_rollout_reports_every_mode(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    code = main(
        [
            "bench",
            "rollout",
            "--model",
            "tiny-sd3",
            "-n",
            "3",
            "--steps",
            "3",
            "--size",
            "64",
            "--guidance-scale",
            "2.0",
            "--serial-samples",
            "2",
            "--peak-seconds",
            "0.05",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert list(modes) == ["pipeline-serial", "pipeline-batched", "engine-batched", "engine-concurrent"]
    for name, mode in modes.items():
        assert mode["images_per_second"] > 0 and 0 < mode["mfu"], name
    assert modes["pipeline-serial"]["images_per_run"] == 2
    # generate_batched: every forward carries all 3 samples' cond + uncond rows, one per step.
    assert modes["engine-batched"]["rows_per_forward_hist"] == {"6": 3}
    # Concurrent single requests must share forwards (trap: batching silently off).
    assert modes["engine-concurrent"]["mean_rows_per_forward"] > 2
    flops = report["flops"]
    assert flops["per_image"] == 3 * 2 * flops["transformer_per_row"] + flops["decode_per_image"]
    assert "engine-batched / pipeline-batched" in report["ratios"]
    assert "engine-concurrent / engine-batched" in capsys.readouterr().out


def test_bench_rollout_with_lora_runs_the_adapter(tmp_path, capsys):
    """--lora-rank rolls out with the trainer's adapter in place (as a training run's rollouts do):
    the attention projections are LoRA layers in every mode, and the report says so."""
    from flowrl.bench import rollout as rollout_bench

    built = []
    real_init = rollout_bench.RolloutBench.__init__

    def recording_init(self, args):
        real_init(self, args)
        built.append(self.bench.adapter.transformer)

    out = tmp_path / "rollout.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout_bench.RolloutBench, "__init__", recording_init)
        code = main(
            [
                "bench",
                "rollout",
                "--model",
                "tiny-qwen",
                "-n",
                "2",
                "--steps",
                "2",
                "--size",
                "64",
                "--modes",
                "engine-batched",
                "--lora-rank",
                "4",
                "--peak-seconds",
                "0.05",
                "--json",
                str(out),
            ]
        )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["settings"]["lora_rank"] == 4 and report["modes"]["engine-batched"]["images_per_second"] > 0
    to_q = built[0].transformer_blocks[0].attn.to_q
    assert type(to_q) is not torch.nn.Linear and to_q.r["default"] == 4  # a peft LoRA layer of rank 4
    assert "LoRA rank 4" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--modes", "engine-batched,warp-drive"], "--modes"),
        (["--num-layers", "2"], "--num-layers"),
        (["--lora-rank", "-1"], "--lora-rank"),
    ],
)
def test_bench_rollout_bad_input_names_the_flag(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        main(["bench", "rollout", "--model", "tiny-sd3", "--size", "64", "--steps", "1", *argv])


def test_bench_rollout_of_a_video_model_reports_its_shape(tmp_path, capsys):
    """Wan: the report records height, width and frames and its header names them (not --size)."""
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--model", "tiny-wan", "-n", "2", "--steps", "2", "--height", "32", "--width", "48"]
    argv += ["--num-frames", "5", "--guidance-scale", "4.5", "--modes", "pipeline-batched,engine-batched"]
    assert main([*argv, "--peak-seconds", "0.02", "--json", str(out)]) == 0
    settings = json.loads(out.read_text())["settings"]
    assert (settings["height"], settings["width"], settings["num_frames"]) == (32, 48, 5)
    assert "2 samples, 2 steps, 32x48, 5 frames, guidance 4.5" in capsys.readouterr().out
