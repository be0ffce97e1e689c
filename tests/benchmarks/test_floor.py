"""benchmarks/floor.py on the tiny models (CPU): the recorded forward carries all of its FLOPs, and
a setting that would be ignored is refused."""

from __future__ import annotations

import json

import floor
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flowrl.bench.models import build_bench_model, make_trainable
from flowrl.run.flops import transformer_flops_per_row


@pytest.mark.parametrize("model, guidance", [("tiny-qwen", 1.0), ("tiny-sd3", 3.0)])
def test_floor_accounts_for_every_matmul(tmp_path, model, guidance):
    """The recorded Linear calls and attention kernels must carry all of the forward's FLOPs (as
    torch's flop counter sees them): a call the recorder missed would make the floor too low."""
    out = tmp_path / "floor.json"
    code = floor.main(
        [
            "--model",
            model,
            "-n",
            "3",
            "--size",
            "64",
            "--guidance-scale",
            str(guidance),
            "--seconds",
            "0.05",
            "--peak-seconds",
            "0.05",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    parts = report["parts"]
    rows = 6 if guidance > 1 else 3
    assert report["settings"]["rows"] == rows
    bench = build_bench_model(model, "cpu", torch.float32)
    counted = rows * transformer_flops_per_row(bench.adapter, 64, 64)
    recorded = parts["linears"]["flops"] + parts["attention"]["flops"]
    # SD3's patch embedding is a convolution, not a Linear: the only FLOPs outside the record.
    assert 0.97 * counted <= recorded <= counted
    assert parts["linears-fused"]["gemms"] < parts["linears"]["gemms"]  # q, k, v merged per stream
    assert parts["attention"]["calls"] >= 2
    seconds = report["floor"]["seconds_per_forward"]
    assert seconds == pytest.approx(
        min(parts["linears"]["seconds"], parts["linears-fused"]["seconds"]) + parts["attention"]["seconds"]
    )


def _training_matmul_flops(model: str, guidance: float, rank: int) -> int:
    """FLOPs of one forward + backward at the trainer's setup, attention left out, as torch's flop
    counter sees autograd run them: the reference the replayed training products must match."""
    bench = build_bench_model(model, "cpu", torch.float32)
    make_trainable(bench.adapter.transformer, rank, bench.adapter.default_lora_targets)
    forward = floor.velocity_call(bench.adapter, 6 if guidance > 1 else 3, 64, 64, guidance)
    with FlopCounterMode(display=False) as counter:
        forward().sum().backward()
    return sum(flops for op, flops in counter.get_flop_counts()["Global"].items() if "attention" not in str(op))


@pytest.mark.parametrize("model, guidance, rank", [("tiny-qwen", 4.0, 4), ("tiny-sd3", 1.0, 4), ("tiny-sd3", 3.0, 0)])
def test_floor_training_replays_the_backward_autograd_runs(tmp_path, model, guidance, rank):
    """--train replays every matrix product of the trainer's backward and no other: input gradients
    only where an input requires grad, weight gradients only where a weight trains (LoRA factors, or
    every Linear at rank 0), the LoRA factors' four products. A product autograd skips (the
    conditioning path, the latents' own projection) or one the replay missed would move the sum."""
    out = tmp_path / "floor.json"
    argv = ["--model", model, "-n", "3", "--size", "64", "--guidance-scale", str(guidance), "--train"]
    argv += ["--lora-rank", str(rank), "--seconds", "0.02", "--peak-seconds", "0.02", "--json", str(out)]
    assert floor.main(argv) == 0
    report = json.loads(out.read_text())
    parts = report["parts"]
    replayed = parts["linears"]["flops"] + parts["linears-backward"]["flops"]
    replayed += parts["lora"]["flops"] + parts["lora-backward"]["flops"] if rank else 0
    reference = _training_matmul_flops(model, guidance, rank)
    # SD3's patch embedding is a convolution: the only product outside the record.
    assert 0.97 * reference <= replayed <= reference
    assert parts["linears-backward-fused"]["flops"] == parts["linears-backward"]["flops"]
    assert parts["attention-train"]["flops"] == 3 * parts["attention"]["flops"]
    floors = report["floors"]
    names = {"forward", "training"} | ({"forward + LoRA", "training + LoRA"} if rank else set())
    assert set(floors) == names
    training = floors["training + LoRA" if rank else "training"]
    assert training["flops"] == replayed + parts["attention-train"]["flops"]
    assert training["floor_over_limit"] == pytest.approx(
        training["seconds"] / (training["flops"] / report["peak"]["sustained_flops"])
    )


def test_floor_refuses_targets_without_a_rank(capsys):
    with pytest.raises(SystemExit) as exit_info:
        floor.main(["--model", "tiny-qwen", "--lora-targets", "to_q"])
    assert exit_info.value.code == 2
    assert "--lora-targets=to_q needs --lora-rank > 0" in capsys.readouterr().err


def test_floor_takes_a_recipes_text_length(tmp_path):
    """--max-sequence-length sets the prompts' length as a recipe's model.max_sequence_length does
    (SD3: CLIP's 77 tokens, then T5's), so the replayed shapes are the recipe's."""
    reports = {}
    for length in (None, 8):
        out = tmp_path / f"floor-{length}.json"
        argv = ["--model", "tiny-sd3", "-n", "2", "--size", "64", "--seconds", "0.02", "--peak-seconds", "0.02"]
        argv += ["--json", str(out)] + ([] if length is None else ["--max-sequence-length", str(length)])
        assert floor.main(argv) == 0
        reports[length] = json.loads(out.read_text())
    assert reports[8]["settings"]["text_tokens"] == 77 + 8
    assert reports[None]["settings"]["text_tokens"] > 77 + 8
    assert reports[8]["parts"]["attention"]["flops"] < reports[None]["parts"]["attention"]["flops"]
