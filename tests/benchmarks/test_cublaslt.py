"""benchmarks/cublaslt.py (direct cuBLASLt calls for benchmarks/cublaslt_algos.py): bad input is
refused before any library is loaded; on a GPU every candidate computes PyTorch's product."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cublaslt
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"epilogue": "relu"}, "epilogue='relu'"),
        ({"dtype": torch.int8}, "dtype=torch.int8"),
    ],
)
def test_gemm_refuses_what_it_cannot_run(kwargs, fragment):
    settings = {"dtype": torch.bfloat16, **kwargs}
    with pytest.raises(ValueError, match=fragment):
        cublaslt.Gemm(64, 64, 64, **settings)


def test_candidates_script_needs_a_gpu():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "cublaslt_algos.py"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--device: cuBLASLt needs a CUDA device" in done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue, accumulate", [("bias", False), ("gelu_bias", False), ("none", True)])
def test_every_candidate_computes_what_pytorch_computes(epilogue, accumulate):
    """Each heuristic candidate gives PyTorch's result (bias, bias + tanh GELU, or accumulated into
    `out`) to bf16 rounding: operand order, transposes, leading dimensions and epilogue are right."""
    m, n, k = 512, 384, 256
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    start = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    if epilogue == "gelu_bias":
        expected = torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    elif accumulate:
        expected = start.clone().addmm_(x, weight.t())
    else:
        expected = torch.addmm(bias, x, weight.t())
    gemm = cublaslt.Gemm(m, n, k, torch.bfloat16, epilogue=epilogue, accumulate=accumulate)
    candidates = gemm.candidates(bias if epilogue != "none" else None)
    assert candidates
    for algo in candidates:
        out = gemm.run(x, weight, bias, start.clone(), algo)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.02)
        assert set(cublaslt.describe(algo.algo)) >= {"id", "tile"}
