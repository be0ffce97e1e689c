"""The experiments' scripts in benchmarks/ on the CPU (tiny models, small shapes): each runs, and
the variants it times compute the same thing."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(name: str, *args: str) -> str:
    """stdout of `python benchmarks/<name> ARGS --device cpu`, which must succeed. Run in this
    process as `__main__` (a subprocess would pay the imports again for each script); the
    logging levels it quiets and the compiled graphs it leaves are reset afterwards."""
    levels = {name: logging.getLogger(name).level for name in ("diffusers", "transformers")}
    stdout = io.StringIO()
    argv = sys.argv
    sys.argv = [str(BENCHMARKS / name), *args, "--device", "cpu"]
    code = 0
    try:
        with contextlib.redirect_stdout(stdout):
            runpy.run_path(str(BENCHMARKS / name), run_name="__main__")
    except SystemExit as done:
        code = done.code
    finally:
        sys.argv = argv
        for logger, level in levels.items():
            logging.getLogger(logger).setLevel(level)
        torch._dynamo.reset()
    assert code in (0, None), stdout.getvalue()[-2000:]
    return stdout.getvalue()


def test_qwen_block_parts_script_runs_and_rotations_agree():
    """benchmarks/qwen_block_parts.py (small widths): the two RoPE formulations it times are the same
    function (exactly equal in float32)."""
    out = run_script("qwen_block_parts.py", "--rows", "1", "--seconds", "0.01")
    assert "rope: max |unbind/stack - pair swap| = 0\n" in out
    assert "q/k norm + rope, pair swap" in out


def test_qwen_vae_decode_script_runs_and_saves_flops():
    """benchmarks/qwen_vae_decode.py (small VAE): the 2D path counts well under half the stock FLOPs,
    and the two paths' uint8 images differ by at most one level."""
    out = run_script("qwen_vae_decode.py", "--rows", "1", "--size", "64", "--base-dim", "8", "--seconds", "0.01")
    flops = {
        name: float(value)
        for name, value in re.findall(r"^(\S+)\s+[\d.]+ ms per decode of 1\s+([\d.]+) GFLOP", out, re.M)
    }
    assert set(flops) == {"stock-3d", "2d-channels-last"}, out
    assert flops["2d-channels-last"] < 0.45 * flops["stock-3d"], flops
    assert re.search(r"largest pixel difference [01] \(of 255\)", out), out


def _block_variants(variants: str, *flags: str, script: str = "qwen_block_variants.py") -> str:
    """A block benchmark's output on the CPU (benchmarks/qwen_block_variants.py, or `script`, which
    takes the same options): 2 rows, one quick timing and profiled call."""
    return run_script(
        script,
        "--rows",
        "2",
        "--seconds",
        "0.01",
        "--profile-calls",
        "1",
        *flags,
        "--variants",
        variants,
    )


def test_qwen_block_variants_script_runs_and_layouts_agree():
    """benchmarks/qwen_block_variants.py on the CPU (small block, float32): every variant runs,
    extra inductor options parse, and the layouts compute the same block: up to float32 rounding,
    since the sequence-major block's joint sequence is image first, so its attention sums the keys
    in another order."""
    out = _block_variants(
        "batch-major:eager,sequence-major:eager,sequence-major:fused:realize_opcount_threshold=50,"
        "sequence-major:eager:joint_kernel=0"
    )
    lines = [line for line in out.splitlines() if "max |out - first|" in line]
    assert [line.split()[0] for line in lines] == [
        "batch-major:eager",
        "sequence-major:eager",
        "sequence-major:fused:realize_opcount_threshold=50",
        "sequence-major:eager:joint_kernel=0",
    ]
    assert all(float(line.rsplit(" ", 1)[1]) < 1e-5 for line in lines), lines


def test_qwen_block_variants_runs_the_recipes_lora_on_a_masked_batch():
    """qwen_block_variants.py with --text-mask (padded text rows) and the recipe's LoRA targets
    (attention and MLP projections): both layouts run and compute the same block (float32 on the
    CPU: the folded low-rank term changes only the summation order), each launched both ways asked
    for (--launch), in that order."""
    out = _block_variants(
        "batch-major:eager:lora=4:lora_mlp=1,sequence-major:eager:lora=4:lora_mlp=1",
        "--text-mask",
        "--launch",
        "direct,synced",
    )
    launches = [line.split()[0] for line in out.splitlines() if "ms per block call" in line]
    assert launches == ["direct", "synced"] * 2, out
    lines = [line for line in out.splitlines() if "max |out - first|" in line]
    assert [line.split()[0] for line in lines] == [
        "batch-major:eager:lora=4:lora_mlp=1",
        "sequence-major:eager:lora=4:lora_mlp=1",
    ], out
    assert float(lines[1].rsplit(" ", 1)[1]) < 1e-4, lines


def test_qwen_forward_ab_script_runs_and_configurations_agree():
    """benchmarks/qwen_forward_ab.py on the CPU (tiny model, float32): both layouts, and the four
    table/kernel configurations, run and give the same forward (the kernel does not apply on a
    CPU; the table's GEMM has more rows, which may move float32 rounding; the layouts sum the
    attention's keys in another order)."""
    out = run_script("qwen_forward_ab.py", "--rows", "2", "--seconds", "0.01", "--rounds", "1")
    lines = [line for line in out.splitlines() if "median" in line]
    assert [line.split()[0] for line in lines] == ["sequence-major", "batch-major"]
    assert all(float(line.rsplit(" ", 1)[1]) < 1e-5 for line in lines), lines  # the attention's key order
    out = run_script(
        "qwen_forward_ab.py", "--compare", "table-kernel", "--rows", "2", "--seconds", "0.01", "--rounds", "1"
    )
    lines = [line for line in out.splitlines() if "median" in line]
    assert [" ".join(line.split()[:2]) for line in lines] == [
        "table=1 kernel=1",
        "table=1 kernel=0",
        "table=0 kernel=1",
        "table=0 kernel=0",
    ]
    diffs = [float(line.split()[-1]) for line in lines]
    assert diffs[:2] == [0, 0] and diffs[2] == diffs[3] < 1e-5  # float32 rounding of the table's GEMM only


def test_qwen_gemm_shapes_script_runs_and_chunks_agree():
    """benchmarks/qwen_gemm_shapes.py on the CPU (small shapes): every group is timed, and the
    row-chunked GELU-epilogue GEMM gives the single call's values exactly."""
    out = run_script("qwen_gemm_shapes.py", "--rows", "2", "--seconds", "0.01", "--rounds", "1")
    groups = [line.split(":")[0] for line in out.splitlines() if line.endswith("GFLOP per call")]
    assert groups == ["mlp-up", "mlp-down", "qkv", "modulation", "peak"]
    assert out.count("TFLOP/s") == 10
    assert "max |gelu epilogue, 2 row chunks - the op| = 0\n" in out
    assert "max |gelu epilogue, 4 row chunks - the op| = 0\n" in out


@pytest.mark.parametrize(("model", "lora_rank"), [("qwen-image", 0), ("sd35-medium", 0), ("sd35-medium", 4)])
def test_cuda_graph_ab_script_runs_on_cpu(model, lora_rank):
    """benchmarks/cuda_graph_ab.py on the CPU (the tiny model of the family): the direct compiled
    forward is timed for each row count (graph capture needs a GPU and is not attempted), with the
    trainer's LoRA when asked."""
    out = run_script(
        "cuda_graph_ab.py",
        "--model",
        model,
        "--rows",
        "1,2",
        "--lora-rank",
        str(lora_rank),
        "--seconds",
        "0.01",
        "--rounds",
        "1",
    )
    header = out.splitlines()[0]
    adapted = re.search(r"LoRA rank 4 \((\d+) parameters\)", header)
    assert (adapted is not None and int(adapted.group(1)) > 0) == (lora_rank == 4), header
    timed = [line.split()[:3] for line in out.splitlines() if "median" in line]
    assert timed == [["rows", "1", "direct"], ["rows", "2", "direct"]]
    assert "graph" not in out.split("\n", 1)[1]


def test_lora_merge_time_script_times_every_way_of_merging_the_recipes_adapter():
    """benchmarks/lora_merge_time.py on the tiny Qwen-Image in bf16 (its compiled rounding runs
    too): the recipe's 12 LoRA targets in each of its 2 blocks, and every figure."""
    out = run_script(
        "lora_merge_time.py", "--model", "tiny-qwen", "--rank", "4", "--seconds", "0.01", "--dtype", "bfloat16"
    )
    assert "24 adapted layers" in out, out
    labels = re.findall(r"^  (.+?)\s+[\d.]+ s \(\d+ calls\)$", out, re.M)
    assert labels == [
        "s B A products alone (float32)",
        "merge, drawn noise (eager)",
        "merge, hashed noise compiled",
        "merge, hashed noise eager",
    ], out


def test_lora_joint_k_script_runs_and_its_variants_compute_the_same():
    """benchmarks/lora_joint_k.py (small shapes, float32): the folded and joint-contraction forms of
    the LoRA projections give the float32 reference's outputs, up to summation order."""
    out = run_script(
        "lora_joint_k.py",
        "--tokens",
        "64",
        "--width",
        "32",
        "--mlp-width",
        "64",
        "--rank",
        "4",
        "--seconds",
        "0.01",
        "--rounds",
        "1",
    )
    diffs = {name: float(value) for name, value in re.findall(r"^(\S+): max \|diff\| from float32 (\S+)", out, re.M)}
    assert set(diffs) == {"folded", "joint-qkv", "joint"} and max(diffs.values()) < 1e-5, out
    assert re.search(r"^joint +.*ms over base", out, re.M), out


def test_lora_gemm_gaps_script_runs_and_its_ways_compute_the_same():
    """benchmarks/lora_gemm_gaps.py (small shapes): the folded projections equal the unfolded ones."""
    out = run_script(
        "lora_gemm_gaps.py",
        "--rows",
        "1",
        "--image-tokens",
        "16",
        "--text-tokens",
        "8",
        "--width",
        "32",
        "--mlp-width",
        "64",
        "--rank",
        "4",
        "--blocks",
        "1",
    )
    diffs = {name: float(v) for name, v in re.findall(r"^(\S+): max relative difference to unfolded (\S+)$", out, re.M)}
    assert set(diffs) == {"folded", "folded-base-first", "unfolded", "attention+folded"}, out
    assert max(diffs.values()) < 1e-5, diffs
    assert "base-only" in out and "ms per block" in out
    # the block's masked attention runs on a CPU with SDPA's own backend; the forced ones are CUDA's
    assert re.search(r"^masked-attention\+folded +\S+ ms per block", out, re.M), out
    assert "masked-cudnn" not in out


def test_gemm_memsets_script_times_every_shape_of_both_streams():
    """benchmarks/gemm_memsets.py (small shapes): each stream's three projections, forward and
    input-gradient, timed and counted, and their sum."""
    out = run_script(
        "gemm_memsets.py", "--rows", "1", "--image-tokens", "16", "--text-tokens", "4", "--width", "32",
        "--mlp-width", "64", "--seconds", "0.01",
    )  # fmt: skip
    rows = re.findall(r"^(image|text) \d+x(\d+)->(\d+) (forward addmm|input-grad mm) +default .* memsets 0 ", out, re.M)
    assert len(rows) == 12 and {(k, n) for _, k, n, _ in rows} == {("32", "32"), ("32", "64"), ("64", "32")}, out
    assert re.search(r"^sum over the shapes: default \S+ ms$", out, re.M), out


def test_qwen_train_block_script_trains_the_recipes_lora_and_times_both_graphs():
    """benchmarks/qwen_train_block.py on the CPU: the recipe's LoRA targets (8 attention and 4 MLP
    projections: 24 LoRA tensors) all get gradients, the block without LoRA none, and each variant
    reports its training call against its forward, and how long each graph's first call took."""
    out = _block_variants(
        "sequence-major:eager:lora=4:lora_mlp=1,sequence-major:eager", "--text-mask", script="qwen_train_block.py"
    )
    heads = re.findall(r"^(\S+)\s+max \|grad graph - no-grad graph\| (\S+); (\d+) LoRA gradients$", out, re.M)
    assert [(spec, int(count)) for spec, _, count in heads] == [
        ("sequence-major:eager:lora=4:lora_mlp=1", 24),
        ("sequence-major:eager", 0),
    ], out
    assert all(float(gap) < 1e-4 for _, gap, _ in heads)  # float32: the two graphs differ by summation order
    ratios = re.findall(r"train \(fwd \+ bwd\)\s+[\d.]+ ms per call = ([\d.]+) x the forward", out)
    assert len(ratios) == 2 and all(float(r) > 1 for r in ratios), out
    compiles = re.findall(r"compiling: no-grad graph ([\d.]+) s, grad graph \(forward \+ backward\) ([\d.]+) s", out)
    assert len(compiles) == 2 and all(float(s) > 0 for pair in compiles for s in pair), out


def test_qwen_text_mask_attention_script_agrees_with_the_masked_call():
    """benchmarks/qwen_text_mask_attention.py on the CPU: the per-run attention computes the masked
    call's output at both shapes; without the mask the output differs (the padded keys count)."""
    out = run_script("qwen_text_mask_attention.py", "--seconds", "0.01")
    diffs = dict(
        re.findall(r"^ *(\d+ rows [a-z +]+? (?:masked|per run|no mask)) .* max \|out - masked\| (\S+)$", out, re.M)
    )
    assert len(diffs) == 6, out
    for key, diff in diffs.items():
        assert (float(diff) < 1e-5) == (not key.endswith("no mask")), out


def test_qwen_block_variants_with_and_without_per_run_attention_agree():
    """qwen_block_variants.py --text-mask with the padded batch's attention per run of equal text
    lengths and as one masked call: the same block output (float32 on the CPU)."""
    out = _block_variants("sequence-major:eager,sequence-major:eager:prefix_attention=0", "--text-mask")
    lines = [line for line in out.splitlines() if "max |out - first|" in line]
    assert len(lines) == 2 and float(lines[1].rsplit(" ", 1)[1]) < 1e-4, out


def test_qwen_train_block_runs_a_variant_with_one_sdpa_backend():
    """qwen_train_block.py with `sdpa=math`: the block's attention runs SDPA's math backend (no
    fused CPU attention op among its ops, which the default variant runs), and every LoRA tensor of
    the attention projections (8, two each) gets a gradient."""
    out = _block_variants(
        "sequence-major:eager:lora=4,sequence-major:eager:lora=4:sdpa=math",
        "--top",
        "200",
        script="qwen_train_block.py",
    )
    default, math = re.split(r"^sequence-major:eager:lora=4:sdpa=math ", out, flags=re.M)[-2:]
    fused = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert fused in default and fused not in math, out
    heads = re.findall(r"max \|grad graph - no-grad graph\| (\S+); (\d+) LoRA gradients$", out, re.M)
    assert [int(count) for _, count in heads] == [16, 16], out


def test_qwen_block_variants_refuses_an_unknown_sdpa_backend():
    from qwen_block_variants import parse_variant

    with pytest.raises(SystemExit, match="sdpa='fast'.*cudnn, flash, efficient, math"):
        parse_variant("sequence-major:eager:sdpa=fast")


def test_attention_backends_script_times_each_backend_forward_and_backward():
    """benchmarks/attention_backends.py on the CPU (small shapes, the math backend and SDPA's own
    choice): each backend's forward and forward + backward timed with a TFLOP/s, and its output
    compared with the default's."""
    out = run_script(
        "attention_backends.py", "--shapes", "qwen-train", "sd35-train", "--seconds", "0.01", "--rounds", "1"
    )
    rows = re.findall(r"^  (default|MATH) +(forward|fwd\+bwd) .* median +\S+ ms +\S+ TFLOP/s$", out, re.M)
    assert len(rows) == 8 and {backend for backend, _ in rows} == {"default", "MATH"}, out
    assert len(re.findall(r"largest difference from the default's forward: .*'MATH': '", out)) == 2, out


def test_activation_budget_script_keeps_less_under_a_budget_and_recomputes_products_only_when_low():
    """benchmarks/activation_budget.py on the CPU (a small block with the recipe's LoRA): under 0.9
    the forward keeps less for the backward than torch's default partition with the same products
    in both passes; under 0.1 the backward recomputes products to keep less still."""
    out = run_script(
        "activation_budget.py",
        *("--budgets", "1,0.9,0.1", "--heads", "4", "--head-dim", "32", "--image-tokens", "64"),
        *("--text-tokens", "8", "--rows", "2", "--lora-rank", "4"),
    )
    rows = re.findall(
        r"^budget (\S+): keeps \S+ MiB per call \(([\d.]+)% of the first budget's\); forward (\d+) products .*"
        r"backward (\d+) products",
        out,
        re.M,
    )
    assert [budget for budget, *_ in rows] == ["1", "0.9", "0.1"], out
    (_, full, fw, bw), (_, share, fw_09, bw_09), (_, low, fw_01, bw_01) = rows
    assert float(full) == 100.0 and float(share) < 90.0 and float(low) < float(share), out
    assert fw == fw_09 == fw_01 and bw == bw_09 and int(bw_01) > int(bw), out
