"""benchmarks/floor.py on the tiny models (CPU): the recorded forward carries all of its FLOPs, and
a setting that would be ignored is refused."""

from __future__ import annotations

import json

import floor
import pytest
import torch

from flowrl.bench.flops import transformer_flops_per_row
from flowrl.bench.models import build_bench_model


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


def test_floor_refuses_a_rounding_without_compile(capsys):
    with pytest.raises(SystemExit) as exit_info:
        floor.main(["--model", "tiny-qwen", "--compile-rounding", "fused"])
    assert exit_info.value.code == 2
    assert "--compile-rounding=fused applies to compiled runs only; add --compile" in capsys.readouterr().err
